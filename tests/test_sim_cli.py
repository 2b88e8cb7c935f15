"""``moeserve simulate``: output for a small trace, and one-line errors naming the bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moeserve.cli import main
from tracer.trace_file import TraceRecord, write_traces


def write_trace(
    path: Path, layers: int = 32, experts: int = 8, top_k: int = 2, n: int = 4, seed: int = 0
) -> Path:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        rows = int(rng.integers(3, 8))
        ids = np.stack(
            [
                np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
                for _ in range(rows)
            ]
        )
        records.append(
            TraceRecord(
                f"r{i}",
                f"task{i % 2}",
                None,
                layers,
                experts,
                top_k,
                0,
                ids,
                np.full(ids.shape, 0.5, np.float32),
            )
        )
    write_traces(path, records)
    return path


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_for_one_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    code, out, _ = run_cli(["--trace", str(trace), "--policy", "model-counts", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    (row,) = doc["results"]
    assert row["policy"] == "model-counts" and row["cache"] == "model-counts"
    assert row["lookups"] > 0 and 0 <= row["hit_rate"] <= 1
    assert doc["settings"]["model_profile"] == "mixtral-8x7b"
    assert doc["settings"]["slots"] == 57  # A5000 24 GiB - dense - KV reserve - 1 GiB, / 336 MiB


def test_all_policies_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    code, out, _ = run_cli(["--trace", str(trace), "--all-policies", "--buffer-slots", "40"], capsys)
    assert code == 0
    for label in ("on-demand+lru", "next-layer-all+lru", "model-counts", "hot-experts+lru", "eam", "oracle"):
        assert label in out
    assert "settings:" in out


def test_mapped_profile_is_labelled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", layers=2, experts=8, top_k=2)
    code, out, _ = run_cli(
        ["--trace", str(trace), "--map-profile", "--policy", "on-demand", "--json"], capsys
    )
    assert code == 0
    assert "mixtral-8x7b costs on a L=2 E=8 k=2 trace" in json.loads(out)["settings"]["model_profile"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trace", "{missing}"], "no such trace file"),
        (["--trace", "{bad}"], "bad.jsonl:2"),
        (
            ["--trace", "{good}", "--model-profile", "gpt-moe-9000"],
            "--model-profile 'gpt-moe-9000' is unknown",
        ),
        (["--trace", "{good}", "--hardware", "tpu+pcie4"], "--hardware 'tpu+pcie4' is unknown"),
        (["--trace", "{good}", "--policy", "psychic"], "--policy 'psychic' is unknown"),
        (["--trace", "{good}", "--cache-policy", "fifo"], "--cache-policy 'fifo' is unknown"),
        (["--trace", "{small}"], "pass --map-profile"),
        (["--trace", "{good}", "--batch", "0"], "--batch must be >= 1"),
        (["--trace", "{good}", "--layer-jitter-us", "-5"], "--layer-jitter-us must be >= 0"),
        (["--trace", "{good}", "--warm", "9"], "leaves no request to measure"),
        (
            ["--trace", "{good}", "--model-profile", "deepseek-v3", "--hardware", "a5000"],
            "pass --map-profile",
        ),
    ],
)
def test_bad_input_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    good = write_trace(tmp_path / "good.jsonl")
    small = write_trace(tmp_path / "small.jsonl", layers=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text().splitlines()[0] + "\n{not json\n")
    paths = {"missing": tmp_path / "nope.jsonl", "bad": bad, "good": good, "small": small}
    code, out, err = run_cli([a.format(**paths) for a in args], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeserve: error: ")
    assert needle in lines[0]


def test_profile_without_room_for_an_expert_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moe_runtime.errors import ConfigError
    from moeserve.sim.hardware import get_hardware
    from moeserve.sim.models import get_model

    with pytest.raises(ConfigError, match="deepseek-v3.*leave no room"):
        get_model("deepseek-v3").buffer_slots(get_hardware("a5000"), kv_tokens=200_000)


def test_list_profiles_and_missing_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--list-profiles"], capsys)
    assert code == 0 and "mixtral-8x7b" in out and "nvlink-c2c" in out
    code, out, err = run_cli([], capsys)
    assert code == 2 and "--trace is required" in err and len(err.strip().splitlines()) == 1
