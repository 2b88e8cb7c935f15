"""`moeserve bench memory-split`: the plan's split and fixed fractions at one device memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.bench.memory_split import markdown
from moeserve.cli import main

PROMPTS = Path(__file__).resolve().parents[2] / "shared/data/prompts/prompts_combined.jsonl"


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data/prompts")
def test_plan_and_fractions_share_one_device_memory(capsys):
    argv = ["bench", "memory-split", "--repeats", "1", "--tasks", "1", "--warm", "1", "--eval", "1"]
    argv += ["--batch", "2", "--new-tokens", "4", "--fractions", "0.1,0.3", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert list(rows) == ["plan", "fraction 0.1", "fraction 0.3"]
    assert data["settings"]["device_memory"] > 0 and data["settings"]["share"] == 0.3
    plan = rows["plan"][0]
    assert 0 < plan["slots"] < 512, "the plan must offload at 30% of the experts' memory"
    assert plan["kv_blocks"] > 0 and plan["tpot_ms"] > 0
    assert rows["fraction 0.1"][0]["slots"] < rows["fraction 0.3"][0]["slots"]
    md = markdown(data)  # the docs block: a row per split with its own figures
    assert f"| plan | {plan['slots']} | {plan['kv_blocks']} | " in md and "| fraction 0.3 |" in md
    assert "`share=0.3`" in md
