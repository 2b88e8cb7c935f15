"""``moeserve bench kv``: the scheduler-level replay of the static and paged KV layouts at equal
memory, on a small synthetic trace (the Azure trace's figures are in docs/kv-cache.md)."""

from __future__ import annotations

import json

import pytest

from moe_runtime.engine.request import SamplingParams, Sequence
from moeserve.bench.kv import Settings, StaticRows, markdown, read_lengths, replay, run
from moeserve.cli import main as cli_main
from moeserve.commands.bench import BENCH_MODULES


def _trace(tmp_path, rows: list[tuple[int, int]]):
    path = tmp_path / "trace.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"0,{c},{g}" for c, g in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_static_rows_admit_one_sequence_per_row():
    rows = StaticRows(2, 64, 16)
    seqs = [Sequence(str(i), [0] * 5, SamplingParams()) for i in range(3)]
    assert rows.allocate(seqs[0], 5) and rows.allocate(seqs[0], 1) and rows.allocate(seqs[1], 5)
    assert not rows.allocate(seqs[2], 5) and rows.num_free == 0 and rows.num_blocks == 8
    rows.free(seqs[0])
    assert rows.allocate(seqs[2], 5)


def test_paged_admits_more_at_equal_memory(tmp_path):
    lengths = read_lengths(_trace(tmp_path, [(100 + 7 * i, 20 + i % 9) for i in range(60)] + [(1, 0)]))
    assert lengths[-1].tolist() == [1, 1]  # an empty output counts as one token
    s = Settings(
        max_model_len=1024,
        block_size=16,
        kv_tokens=2 * 1024,
        max_batch_size=64,
        max_num_batched_tokens=512,
        requests=80,
        rate=200.0,
        warmup=8,
        step_ms=5.0,
        token_us=10.0,
    )
    static = replay(lengths, "static", s, seed=0)
    paged = replay(lengths, "paged", s, seed=0)
    assert static["max_concurrency"] == 2 and static["preemptions"] == 0
    assert paged["concurrency"] > 2.5 * static["concurrency"]  # about 6 sequences of ~330 fit
    assert paged["ttft_p50_s"] < static["ttft_p50_s"]
    result = run(lengths, s, [0, 1, 2])
    assert result["settings"]["seeds"] == [0, 1, 2] and result["static"]["rows"] == 2
    assert set(result["paged"]["concurrency"]) == {"median", "min", "max"}
    assert result["concurrency_ratio"]["min"] > 2.5


def test_cli_prints_json_with_settings(tmp_path, capsys):
    assert "moeserve.bench.kv" in BENCH_MODULES
    trace = _trace(tmp_path, [(50 + i, 10) for i in range(40)])
    argv = ["bench", "kv", "--trace", str(trace), "--requests", "30", "--repeats", "3"]
    argv += ["--max-model-len", "256", "--static-rows", "2", "--rate", "100", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["kv_tokens"] == 512 and out["settings"]["warmup"] == 3
    assert out["paged"]["blocks"] == 32 and out["static"]["max_concurrency"]["max"] <= 2


def test_markdown_renders_replays_and_a_prefix_chat(tmp_path, capsys):
    """The docs block's renderer: one table row per (rate, layout) with the replay's own figures,
    the paged/static ratio per rate, and the prefix chat's paragraph; no result at all is refused."""
    trace = _trace(tmp_path, [(50 + i, 10) for i in range(40)])
    docs = []
    for rate in ("100", "5"):
        argv = ["bench", "kv", "--trace", str(trace), "--requests", "30", "--repeats", "3"]
        assert (
            cli_main([*argv, "--max-model-len", "256", "--static-rows", "2", "--rate", rate, "--json"]) == 0
        )
        docs.append(json.loads(capsys.readouterr().out))
    chat = {
        "settings": {"requests": 8, "system_tokens": 1024, "repeats": 3, "device": "cpu", "dtype": "fp32",
                     "block_size": 16},
        "prompt_tokens": 1048, "first_ttft_ms": {"median": 300.0, "min": 290.0, "max": 310.0},
        "later_ttft_ms": {"median": 30.0, "min": 29.0, "max": 33.0},
        "ratio": {"median": 0.1, "min": 0.097, "max": 0.11}, "min_cached_later": 1024, "outputs_equal": True,
    }  # fmt: skip
    md = markdown([*docs, chat])
    rows = [line for line in md.splitlines() if line.startswith("| 100/s") or line.startswith("| 5/s")]
    assert len(rows) == 4 and "static (2 rows of 256)" in rows[0] and "paged (32 blocks of 16)" in rows[1]
    paged = docs[0]["paged"]["concurrency"]["median"]
    assert f"| {paged:.1f} (" in rows[1]
    ratio = docs[0]["concurrency_ratio"]["median"]
    assert f"{ratio:.1f}x" in md and "at 100/s" in md and "at 5/s" in md
    assert "a ratio of 0.100 (0.097-0.110)" in md and "at least 1,024 cached tokens" in md and "yes" in md
    with pytest.raises(ValueError):
        markdown([{"settings": {}}])
