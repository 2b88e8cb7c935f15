"""``moeserve bench ab``: the paired per-batch A/B of policies on the runtime (bundled model)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from moeserve.bench.policy_ab import parse_policy, summarise
from moeserve.cli import main

PROMPTS = Path(__file__).resolve().parents[2] / "shared/data/prompts/prompts_combined.jsonl"


def _run(argv: list[str]) -> dict:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["bench", "ab", *argv, "--json"]) == 0
    return json.loads(buf.getvalue())


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data")
def test_pairs_every_eval_batch_and_the_reference_ratio_is_one() -> None:
    argv = ["--policies", "on-demand+lru,eam", "--fraction", "0.25", "--batch", "2", "--tasks", "2"]
    out = _run([*argv, "--warm", "1", "--eval", "2", "--new-tokens", "4", "--repeats", "3"])
    ref, eam = out["rows"]
    st = out["settings"]
    assert st["reference"] == "on-demand+lru" and st["eval_prompts"] == 4 and st["repeats"] == 3
    assert "warm" in st["warmup"] and len(st["load_avg_before"]) == 3
    assert ref["pairs"] == eam["pairs"] == 3 * 2  # 3 passes over 2 batches of 2
    assert ref["ratio_median"] == ref["ratio_q1"] == ref["ratio_q3"] == 1.0
    assert ref["ratio_pass_min"] == ref["ratio_pass_max"] == 1.0
    assert 0.2 < eam["ratio_median"] < 5 and eam["tpot_ms_median"] > 0
    assert eam["tpot_ms_pass_min"] <= eam["tpot_ms_pass_max"]


def test_an_unknown_policy_or_too_few_repeats_is_refused(capsys) -> None:
    assert main(["bench", "ab", "--policies", "on-demand+lru,sometimes"]) == 2
    assert "unknown or unpaired policy 'sometimes'" in capsys.readouterr().err
    assert main(["bench", "ab", "--repeats", "2"]) == 2
    assert "must be >= 3" in capsys.readouterr().err


def test_an_eam_arm_can_be_pinned_by_label(capsys) -> None:
    """``eam@<arm>`` is the default ``eam`` row held in one arm of its trial; only eam's arms."""
    assert parse_policy("eam@lean") == ("eam", "eam-reuse", {}, "lean")
    assert parse_policy("eam")[3] is None
    for label in ("eam@sometimes", "on-demand+lru@lean", "oracle"):
        with pytest.raises(ValueError, match="unknown or unpaired"):
            parse_policy(label)
    assert main(["bench", "ab", "--policies", "on-demand+lru,eam@fast"]) == 2
    assert "eam@fast" in capsys.readouterr().err


def test_summary_pairs_batch_by_batch_with_the_passes_spread() -> None:
    tpots = {"a": [[1.0, 2.0], [1.0, 2.0], [2.0, 2.0]], "b": [[1.1, 2.2], [0.9, 2.0], [2.0, 3.0]]}
    ref, b = summarise(["a", "b"], tpots)
    assert ref["ratio_median"] == 1.0 and ref["pairs"] == b["pairs"] == 6
    # ratios per pass: [1.1, 1.1], [0.9, 1.0], [1.0, 1.5] -> pass medians 1.1, 0.95, 1.25
    assert b["ratio_median"] == pytest.approx(1.05)
    assert (b["ratio_pass_min"], b["ratio_pass_max"]) == (pytest.approx(0.95), pytest.approx(1.25))
    assert b["tpot_ms_median"] == pytest.approx(2000.0)
    assert (b["tpot_ms_pass_min"], b["tpot_ms_pass_max"]) == (pytest.approx(1450.0), pytest.approx(2500.0))


@pytest.mark.skipif(not PROMPTS.exists(), reason="needs ../shared/data")
def test_a_pinned_eam_row_runs_its_arm_only(monkeypatch) -> None:
    from moe_runtime.prefetch.eam import EAMPrefetch

    pinned = []
    pin = EAMPrefetch.pin
    monkeypatch.setattr(EAMPrefetch, "pin", lambda self, arm: (pinned.append(self), pin(self, arm))[1])
    argv = ["--policies", "on-demand+lru,eam@lean", "--fraction", "0.25", "--batch", "2", "--tasks", "1"]
    rows = _run([*argv, "--warm", "1", "--eval", "2", "--new-tokens", "4", "--repeats", "3"])["rows"]
    assert [r["policy"] for r in rows] == ["on-demand+lru", "eam@lean"]
    (pf,) = pinned
    assert pf.idle and pf.plans == 0 and pf.trial.decode_steps == 0
