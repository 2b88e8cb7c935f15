"""``moeserve bench experts``: both paths timed on the bundled shape, outputs compared, table and
settings written; bad flags give one line and exit 2."""

from __future__ import annotations

import json

import pytest

from moeserve.cli import main


def test_bench_experts_json_and_markdown(capsys, tmp_path):
    doc = tmp_path / "bench-experts.md"
    args = ["bench", "experts", "--shapes", "bundled", "--tokens", "1,4", "--calls", "1", "--warmup", "0"]
    rc = main([*args, "--dtype", "fp32", "--json", "--markdown", str(doc)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["device"] == "cpu" and data["settings"]["repeats"] == 3
    rows = data["results"]
    assert [r["tokens"] for r in rows] == [1, 4]
    assert [r["step_path"] for r in rows] == ["few", "grouped"]  # FEW_TOKENS on the CPU: 3
    for r in rows:
        assert r["identical"] and r["probe_path"] == "grouped"
        assert 1 <= r["experts_used"] <= r["tokens"] * r["top_k"]
        for path in ("loop_us", "grouped_us", "few_us"):
            assert len(r[path]["runs"]) == 3 and r[path]["min"] <= r[path]["median"] <= r[path]["max"]
    text = doc.read_text()
    assert "moeserve bench experts --device cpu --dtype fp32 --shapes bundled --tokens 1,4" in text
    assert text.count("| bundled |") == 2


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--shapes", "gpt-5", "unknown shape 'gpt-5'"),
        ("--tokens", "0", "--tokens"),
        ("--repeats", "2", "--repeats must be >= 3"),
        ("--device", "tpu", "--device 'tpu'"),
    ],
)
def test_bench_experts_bad_flags(capsys, flag, value, said):
    rc = main(["bench", "experts", flag, value])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and said in err, err
