"""``tools/expert_layout.py``: where a cache policy's slots put a layer's experts (bundled model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tool_module import load_tool

PROMPTS = Path(__file__).resolve().parents[2] / "shared/data/prompts/prompts_combined.jsonl"


@pytest.fixture(scope="module")
def expert_layout():
    return load_tool("expert_layout")


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data")
def test_counts_each_policys_segments_over_the_same_experts(expert_layout, capsys) -> None:
    argv = ["--policies", "on-demand+lru,eam@cache", "--fraction", "0.1", "--batch", "2", "--tasks", "2"]
    argv += ["--warm", "1", "--eval", "1", "--new-tokens", "4", "--json"]
    assert expert_layout.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    lru, cache = out["rows"]
    assert out["settings"]["link_gbps"] == "off" and out["settings"]["batch"] == 2
    # the same routing (outputs do not depend on the policy), so the same experts per layer
    assert lru["experts_per_layer"] == cache["experts_per_layer"] > 0
    for row in (lru, cache):
        assert row["run_experts_cpu_us_per_layer"] > 0
        # a segment holds at least one expert and spans at least its experts' slots
        assert 0 < row["segments_per_layer"] <= row["slots_spanned_per_layer"]
        assert row["one_expert_segments_per_layer"] <= row["segments_per_layer"]
        assert 0 <= row["hit_rate"] <= 1


def test_an_unknown_policy_is_refused(expert_layout, capsys) -> None:
    with pytest.raises(SystemExit):
        expert_layout.main(["--policies", "on-demand+lru,sometimes"])
    assert "unknown or unpaired policy 'sometimes'" in capsys.readouterr().err


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data")
def test_the_counters_are_removed_after_a_run(expert_layout, capsys) -> None:
    """The tool wraps ``LayerPlan.calls`` and ``moe.run_experts`` only while it measures."""
    from moe_runtime.layers import experts, moe

    calls, run = experts.LayerPlan.calls, moe.run_experts
    argv = ["--policies", "on-demand+lru", "--batch", "2", "--tasks", "1", "--warm", "1", "--eval", "1"]
    assert expert_layout.main([*argv, "--new-tokens", "2", "--json"]) == 0
    capsys.readouterr()
    assert experts.LayerPlan.calls is calls and moe.run_experts is run
