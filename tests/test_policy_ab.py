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


def test_an_eam_arm_can_be_pinned_by_label(policy_ab, capsys) -> None:
    """``eam@<arm>`` is the default ``eam`` row held in one arm of its trial; only eam's arms."""
    assert policy_ab.parse_policy("eam@lean") == ("eam", "eam-reuse", {}, "lean")
    assert policy_ab.parse_policy("eam")[3] is None
    for label in ("eam@sometimes", "on-demand+lru@lean", "oracle"):
        with pytest.raises(ValueError, match="unknown or unpaired"):
            policy_ab.parse_policy(label)
    with pytest.raises(SystemExit):
        policy_ab.main(["--policies", "on-demand+lru,eam@fast"])
    assert "eam@fast" in capsys.readouterr().err


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data")
def test_a_pinned_eam_row_runs_its_arm_only(policy_ab, capsys, monkeypatch) -> None:
    from moe_runtime.prefetch.eam import EAMPrefetch

    pinned = []
    pin = EAMPrefetch.pin
    monkeypatch.setattr(EAMPrefetch, "pin", lambda self, arm: (pinned.append(self), pin(self, arm))[1])
    argv = ["--policies", "on-demand+lru,eam@lean", "--fraction", "0.25", "--batch", "2", "--tasks", "1"]
    argv += ["--warm", "1", "--eval", "2", "--new-tokens", "4", "--repeats", "3", "--json"]
    assert policy_ab.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == ["on-demand+lru", "eam@lean"]
    (pf,) = pinned
    assert pf.idle and pf.plans == 0 and pf.trial.decode_steps == 0
