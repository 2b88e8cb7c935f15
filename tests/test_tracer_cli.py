"""Routing-log import, trace stats, predict-eval and the EAMC benchmark, through their CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from moeserve.bench import eamc as bench_eamc
from moeserve.commands import trace as trace_cmd
from tracer.analysis import top_quarter_share, trace_stats
from tracer.errors import TracerError
from tracer.import_routing import import_routing
from tracer.predict_eval import evaluate
from tracer.trace_file import TraceRecord, load_traces

L, E, K = 4, 8, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve")
    sub = parser.add_subparsers(dest="command")
    trace_cmd.register(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    bench_eamc.register_bench(bench)
    return parser


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    args = _parser().parse_args(list(argv))
    assert args.func(args) == 0
    return capsys.readouterr().out


def _routing_log(path: Path, problems: dict[int, int], seed: int = 0, drop_last: bool = True) -> None:
    """A log in the vLLM routing format: one line per (problem, layer, token)."""
    rng = np.random.default_rng(seed)
    lines = []
    for pid, tokens in problems.items():
        for layer in range(L):
            n = tokens - (1 if drop_last and layer % 2 else 0)  # like the real logs: tail gaps
            for t in range(n):
                experts = rng.choice(E, K, replace=False).tolist()
                lines.append(
                    {"dataset": "gsm8k", "problem_id": pid, "layer": layer, "experts": experts,
                     "gating_probs": [0.7, 0.3], "token_idx": t}
                )  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_import_groups_requests_and_marks_gaps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "x_routing.jsonl"
    _routing_log(src, {0: 6, 1: 3})
    dst = tmp_path / "runs" / "traces" / "t.jsonl"  # folders missing, as on a fresh clone
    out = _run(capsys, "trace", "import", str(src), "--out", str(dst), "--num-experts", "8")
    assert "wrote 2 requests" in out and "(token, layer) cells missing" in out
    recs = load_traces(dst)
    assert [r.request_id for r in recs] == ["gsm8k-0", "gsm8k-1"]
    r0 = recs[0]
    assert (r0.num_tokens, r0.num_layers, r0.num_experts, r0.top_k, r0.num_prefill) == (6, L, E, K, 0)
    assert r0.prompt_len is None and r0.meta["missing_cells"] == 2
    assert (r0.ids[5, 1] == -1).all() and (r0.ids[5, 0] >= 0).all()
    assert r0.eam(prefill=False).sum(axis=1).tolist() == [12, 10, 12, 10]


def test_import_errors_name_file_and_line(tmp_path: Path) -> None:
    src = tmp_path / "bad_routing.jsonl"
    _routing_log(src, {0: 2})
    lines = src.read_text().splitlines()
    src.write_text("\n".join([*lines, lines[0]]) + "\n")  # a duplicate cell
    with pytest.raises(TracerError, match=rf"{src}:{len(lines) + 1}: duplicate line for token 0 at layer 0"):
        import_routing([src])
    src.write_text('{"dataset": "a", "problem_id": 0}\n')
    with pytest.raises(TracerError, match=rf"{src}:1: missing field 'layer'"):
        import_routing([src])


def test_stats_on_known_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = np.zeros((4, L, K), dtype=np.int64)
    ids[:, :, 1] = 1  # every token routes to experts 0 and 1 at every layer
    rec = TraceRecord("a", None, 2, L, E, K, 2, ids, np.ones(ids.shape, np.float32))
    stats = trace_stats([rec])
    assert stats["activation_ratio"]["prefill"]["mean"] == pytest.approx(2 / E)
    assert stats["skew_top25"]["request_all"]["mean"] == pytest.approx(1.0)
    assert stats["skew_top25"]["uniform"] == 0.25
    assert top_quarter_share(np.full((2, 8), 3)) == pytest.approx(0.25)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec.to_json()) + "\n")
    out = json.loads(_run(capsys, "trace", "stats", str(path), "--json"))
    assert out["tokens"] == {"prefill": 2, "decode": 2}
    assert "cross-layer correlation" in _run(capsys, "trace", "stats", str(path))


def test_predict_eval_scores_known_cases() -> None:
    # every token repeats one fixed path: the previous token and a matching EAMC are always right
    ids = np.broadcast_to(np.array([[0, 1], [2, 3], [4, 5], [6, 7]]), (5, L, K)).copy()
    rec = TraceRecord("a", None, 0, L, E, K, 0, ids, np.ones(ids.shape, np.float32))
    result = evaluate([rec], [rec], distances=(1, 2), matches=1)
    rows = {(r["method"], r["d"]): r for r in result["rows"]}
    for method in ("eamc", "model-counts", "prev-token", "request-eam"):
        assert rows[(method, 1)]["precision"] == 1.0 == rows[(method, 1)]["recall"]
    assert rows[("eamc", 1)]["events"] == 4 * (L - 1)  # tokens 1..4, layers 0..L-2
    assert result["settings"]["eval_tokens"] == 4
    wide = evaluate([rec], [rec], distances=(1,), predict_k=4)
    assert {(r["method"], r["precision"], r["recall"]) for r in wide["rows"]} >= {("eamc", 0.5, 1.0)}


def test_predict_eval_cli_and_shape_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "x_routing.jsonl"
    _routing_log(src, {0: 6, 1: 5, 2: 4}, seed=3)
    _run(capsys, "trace", "import", str(src), "--out", str(tmp_path / "t.jsonl"), "--num-experts", "8")
    trace = str(tmp_path / "t.jsonl")
    out = json.loads(_run(capsys, "trace", "predict-eval", "--warm", trace, "--eval", trace, "--json"))
    assert {r["method"] for r in out["rows"]} == {"eamc", "model-counts", "prev-token", "request-eam"}
    assert out["settings"]["eamc_entries"] == 3
    assert out["settings"]["warm"] == "t.jsonl"  # an absolute path outside the working folder: its name
    other = TraceRecord(
        "b", None, 0, L, 16, K, 0, np.zeros((1, L, K), np.int64), np.zeros((1, L, K), np.float32)
    )
    with pytest.raises(
        TracerError,
        match=r"predict-eval: request gsm8k-0 is of shape \(L, E, k\) = \(4, 8, 2\), others \(4, 16, 2\)",
    ):
        evaluate(load_traces(tmp_path / "t.jsonl"), [other])


def test_bench_eamc_reports_settings_and_recall(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "eamc",
        "--capacity",
        "300",
        "--layers",
        "4",
        "--experts",
        "8",
        "--iters",
        "20",
        "--warmup",
        "2",
    ]
    out = json.loads(_run(capsys, *argv, "--json"))
    assert out["settings"]["entries"] == 300 and out["batch1"]["median_us"] > 0
    assert out["batch16"]["per_query_us"] == pytest.approx(out["batch16"]["median_us"] / 16, abs=0.1)
    ivf = json.loads(_run(capsys, *argv, "--index", "ivf", "--nlist", "4", "--nprobe", "4", "--json"))
    assert ivf["settings"]["trained"] and ivf["recall_at_4"] == pytest.approx(1.0, abs=0.02)
    assert "search, batch 16" in _run(capsys, *argv)


def test_moeserve_main_prints_tracer_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moeserve.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["trace", "stats", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moeserve: error: {bad}:1: bad JSON") and err.count("\n") == 1


def test_import_real_mixtral_routing_logs(shared_data: Path) -> None:
    folder = shared_data / "routing_traces" / "mixtral_8x7b_instruct_fp8"
    recs = import_routing(sorted(folder.glob("*_routing.jsonl")))
    assert [r.request_id for r in recs] == ["gsm8k-0", "gsm8k-1", "humaneval-0", "humaneval-1"]
    assert {(r.num_layers, r.num_experts, r.top_k) for r in recs} == {(32, 8, 2)}
    for r in recs:
        recorded = (r.ids[:, :, 0] >= 0).sum(axis=0)  # tokens logged per layer
        assert (r.eam(prefill=False).sum(axis=1) == recorded * 2).all()
        assert r.meta["missing_cells"] == int((r.ids[:, :, 0] < 0).sum()) <= 3 * 32
