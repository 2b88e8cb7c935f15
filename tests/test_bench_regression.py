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


class _FakeEngine:
    """Stands in for ``LLMEngine``: records prompts, finishes the requests in two steps."""

    prompts: list[tuple[int, ...]] = []

    def __init__(self) -> None:
        self.config = argparse.Namespace(vocab_size=50)
        self.buffer = argparse.Namespace(stats=argparse.Namespace(demand_bytes=0, prefetch_bytes=0))
        self._open = 0

    @classmethod
    def from_pretrained(cls, model, runtime):
        return cls()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def add_request(self, rid, prompt, params):
        _FakeEngine.prompts.append(tuple(prompt))
        self._open = 2

    def step(self):
        self._open -= 1

    def has_unfinished(self):
        return self._open > 0


def test_every_run_prefills_a_prompt_no_earlier_run_used(tool, monkeypatch):
    """A tree with prefix caching must not time a cache hit: the warm-up and each timed run of
    every row draw their own prompts (the same seeded draws in both trees)."""
    import moe_runtime.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "LLMEngine", _FakeEngine)
    monkeypatch.setattr(tool, "DECODE_ROWS", [(1.0, 2)])
    _FakeEngine.prompts = []
    out = tool.worker("unused", new_tokens=2, prompt_len=6, prefill_len=9)
    assert set(out) == {"decode 100% batch 2", "prefill 100% 9 tokens"}
    runs = 1 + tool.RUNS
    assert len(_FakeEngine.prompts) == 2 * runs + runs
    assert len(set(_FakeEngine.prompts)) == len(_FakeEngine.prompts)
    first = list(_FakeEngine.prompts)
    _FakeEngine.prompts = []
    tool.worker("unused", new_tokens=2, prompt_len=6, prefill_len=9)
    assert _FakeEngine.prompts == first


def test_json_result_renders_as_the_docs_block(tool):
    """``--json`` prints ``{"settings", "runs"}``; ``render`` (tools/docs.py's block) gives the same
    table as the report, with the settings."""
    runs = {"old": [_run(10.0)], "new": [_run(5.0)]}
    result = {"settings": {"old": "abc", "load_avg_1min": "1.00"}, "runs": runs}
    text = tool.render(result)
    assert "| decode 25% batch 8 | 10.00 | 5.00 | 0.50 |" in text
    assert "Settings: `old=abc`, `load_avg_1min=1.00`" in text
