"""``moeserve bench overhead``: figures per hook with their settings, over all layers, the layers
that plan and with the gate forced open; bad values exit 2."""

from __future__ import annotations

import json

import pytest

from moeserve.cli import main


def test_json_reports_every_hook_with_spread_and_settings(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "overhead", "--model-profile", "mixtral-8x7b", "--batch", "1", "2", "--tokens", "3"]
    code = main([*args, "--warm-requests", "2", "--warmup-steps", "1", "--repeats", "2", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["model_profile"] == "mixtral-8x7b" and doc["settings"]["repeats"] == 2
    assert doc["settings"]["policies"].startswith("prefetch eam + cache ")
    assert doc["settings"]["eamc_term"] == "weighed"  # as the runtime: its gain against its host time
    assert [r["batch"] for r in doc["results"]] == [1, 2]
    for row in doc["results"]:
        assert row["layers_timed"] == 2 * 32  # (3 tokens - 1 warm-up step) x 32 layers
        for prefix in ("", "open_"):  # the gate as it decides, and forced open
            for name in ("total", "record", "cache", "lookahead", "plan"):
                lo, hi = row[f"{prefix}{name}_p50_spread_us"]
                assert 0 <= lo <= row[f"{prefix}{name}_p50_us"] <= hi
                assert row[f"{prefix}{name}_p50_us"] <= row[f"{prefix}{name}_p90_us"]
        assert 0 < row["planned_share"] <= 1
        assert 0 < row["eamc_term_share"] <= 1 and 0 < row["open_eamc_term_share"] <= 1
        # forced open, every layer plans: its median layer costs what a planning layer costs,
        # more than the median layer of a gate that is mostly closed
        assert row["open_plan_p50_us"] > row["plan_p50_us"] or row["planned_share"] == 1
        assert row["planned_total_p50_us"] > 0
        # the mix behind planned_total: each step's first plan, the other plans with the EAMC
        # term, the rest; their shares of the planning layers add up to one
        kinds = row["planned_kinds"]
        assert set(kinds) == {"step_first", "term_in", "term_out"}
        assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0, abs=0.01)
        assert kinds["step_first"]["share"] > 0 and kinds["step_first"]["p50_us"] > 0
        assert all(k["p50_us"] is None or k["p50_us"] > 0 for k in kinds.values())
        within = {k: row[f"{k}_p50_us"] <= 50.0 for k in ("total", "planned_total", "open_total")}
        assert all(row[f"{k}_within_budget"] == v for k, v in within.items())
        assert row["meets_budget"] == all(within.values())


def test_sections_split_a_planning_layers_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "overhead", "--model-profile", "mixtral-8x7b", "--batch", "2", "--tokens", "3"]
    args += ["--warm-requests", "2", "--warmup-steps", "1", "--repeats", "1"]
    assert main([*args, "--sections", "--eamc-term", "always", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["open_eamc_term_share"] == 1.0  # --eamc-term always: every plan matches, as the simulator
    assert "planned_kinds" not in row  # no term weighed: no kinds to tell apart
    parts = [row[f"open_section_{name}_p50_us"] for name in ("predict", "lookahead", "gate", "queue")]
    assert all(p >= 0 for p in parts) and parts[0] > 0 and parts[3] > 0  # every plan predicts and queues
    # p50s of parts need not add up, but no part of a plan costs more than the whole plan's p90
    assert max(parts) <= row["open_plan_p90_us"]


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--buffer", "1.5"], ["--batch", "0"]])
def test_bad_values_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", *bad]) == 2
    assert "--" in capsys.readouterr().err


def test_the_eamc_is_warmed_to_its_default_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    """By default the warm requests fill the EAMC to the capacity a serving run holds once warm,
    so the matching the figures include is the steady state's (``tracer.eamc.DEFAULT_CAPACITY``)."""
    from tracer.eamc import DEFAULT_CAPACITY

    args = ["bench", "overhead", "--model-profile", "mixtral-8x7b", "--batch", "1", "--tokens", "2"]
    assert main([*args, "--warmup-steps", "0", "--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["warm_requests"] == DEFAULT_CAPACITY
    assert 0 <= doc["results"][0]["eamc_term_share"] <= 1  # counted over the timed steps alone
