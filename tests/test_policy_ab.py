"""``tools/policy_ab.py``: the paired per-batch A/B of policies on the runtime (bundled model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tool_module import load_tool

PROMPTS = Path(__file__).resolve().parents[2] / "shared/data/prompts/prompts_combined.jsonl"


@pytest.fixture(scope="module")
def policy_ab():
    return load_tool("policy_ab")


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data")
def test_pairs_every_eval_batch_and_the_reference_ratio_is_one(policy_ab, capsys) -> None:
    argv = ["--policies", "on-demand+lru,eam", "--fraction", "0.25", "--batch", "2", "--tasks", "2"]
    argv += ["--warm", "1", "--eval", "2", "--new-tokens", "4", "--repeats", "3", "--json"]
    assert policy_ab.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref, eam = out["rows"]
    assert out["settings"]["reference"] == "on-demand+lru" and out["settings"]["eval_prompts"] == 4
    assert ref["pairs"] == eam["pairs"] == 3 * 2  # 3 passes over 2 batches of 2
    assert ref["ratio_median"] == ref["ratio_q1"] == ref["ratio_q3"] == 1.0
    assert 0.2 < eam["ratio_median"] < 5 and eam["tpot_ms_median"] > 0


def test_an_unknown_policy_or_too_few_repeats_is_refused(policy_ab, capsys) -> None:
    with pytest.raises(SystemExit):
        policy_ab.main(["--policies", "on-demand+lru,sometimes"])
    assert "unknown or unpaired policy 'sometimes'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        policy_ab.main(["--repeats", "2"])
    assert "must be >= 3" in capsys.readouterr().err
