"""``tools/bench_regression.py``: per-repeat ratios and the report table, and its one-line errors
(the workers themselves are exercised by running the tool)."""

from __future__ import annotations

import argparse

import pytest
from tool_module import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_regression")


def _run(cpu: float, kib: float = 0.0) -> dict:
    return {"decode 25% batch 8": {"cpu_ms": cpu, "wall_ms": 2 * cpu, "kib_moved": kib}}


def test_report_ratios_per_repeat(tool):
    runs = {
        "old": [_run(10.0, 100), _run(20.0, 100), _run(12.0, 100)],
        "new": [_run(8.0, 90), _run(10.0, 90), _run(12.0, 90)],
    }
    args = argparse.Namespace(
        base="abc1234", repeats=3, new_tokens=32, prompt_len=32, prefill_len=512, out="runs/r.md"
    )
    text = tool.report("a" * 40, runs, args, 1.0)
    row = next(line for line in text.splitlines() if line.startswith("| decode 25% batch 8"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # medians 12 -> 10; per-repeat ratios 0.8, 0.5, 1.0 (median 0.8); best/best 8 / 10
    assert cells[1:6] == ["12.00", "10.00", "0.80", "0.50-1.00", "0.80"]
    assert cells[6:8] == ["24.00", "20.00"] and cells[-1] == "100, 90"
    assert "--base abc1234 --out runs/r.md" in text and "`old=aaaaaaaaaaaa`" in text


def test_unknown_base_is_one_line_exit_2(tool, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        tool.export("no-such-commit", tmp_path)
    assert err.value.code == 2
    msg = capsys.readouterr().err.strip()
    assert msg == "bench_regression: --base: unknown commit 'no-such-commit'"
