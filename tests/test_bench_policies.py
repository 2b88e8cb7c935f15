"""``moeserve bench policies --repeats``: medians, spreads, and verdicts only outside the noise.

The summary logic is checked on synthetic rounds whose figures are chosen so the expected median,
spread and verdict follow by hand; one short real run of the bundled model checks the CLI end to
end (``--repeats`` refused below 3, the JSON's fields, the rendered Markdown).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from moeserve.bench.policies import PolicyResult
from moeserve.bench.policy_summary import compare, paired, summarise, target, verdicts
from moeserve.bench.render import render_policies
from moeserve.cli import main


def _res(policy: str, tpot: float, blocking: float = 1.0) -> PolicyResult:
    return PolicyResult(0.25, 128, policy, 0.5, blocking, 1000.0, tpot, 0, 0, 0, 96)


def _rounds(od: list, eam: list, oracle: list, eam_blocking=(1.0, 1.0, 1.0)) -> list[list[PolicyResult]]:
    return [
        [_res("on-demand+lru", o, blocking=2.0), _res("eam", e, blocking=b), _res("oracle", x, blocking=0.5)]
        for o, e, x, b in zip(od, eam, oracle, eam_blocking, strict=True)
    ]


def test_median_and_spread_over_rounds_and_paired_ratios() -> None:
    rows = summarise(_rounds(od=[20.0, 22.0, 30.0], eam=[16.0, 23.1, 18.0], oracle=[10.0, 12.0, 14.0]))
    eam = next(r for r in rows if r.policy == "eam")
    assert (eam.tpot_ms, eam.tpot_ms_min, eam.tpot_ms_max) == (18.0, 16.0, 23.1)
    assert eam.runs["tpot_ms"] == [16.0, 23.1, 18.0]  # round order kept
    # paired per round: 16/20, 23.1/22, 18/30 -> median 0.8, spread 0.6..1.05
    assert eam.tpot_vs_on_demand == pytest.approx(0.8)
    assert (eam.tpot_vs_on_demand_min, eam.tpot_vs_on_demand_max) == (pytest.approx(0.6), pytest.approx(1.05))
    # gap closed paired per round: 4/10, -1.1/10, 12/16 -> median 0.4, spread -0.11..0.75
    assert eam.gap_closed == pytest.approx(0.4)
    assert eam.gap_closed_min == pytest.approx((22 - 23.1) / 10)
    assert eam.gap_closed_max == pytest.approx((30 - 18) / 16)
    assert eam.bytes_vs_oracle == 1.0
    # where the per-round median differs from the medians' gap (21 - 19) / (21 - 10) = 0.18,
    # the figure is the per-round one, within its own spread: 1/10, 6/7, 5/20 -> 0.25
    eam = next(
        r
        for r in summarise(_rounds(od=[20.0, 21.0, 30.0], eam=[19.0, 15.0, 25.0], oracle=[10.0, 14.0, 10.0]))
        if r.policy == "eam"
    )
    assert eam.gap_closed == pytest.approx(0.25)
    assert eam.gap_closed_min <= eam.gap_closed <= eam.gap_closed_max


def test_verdict_only_when_the_spreads_separate() -> None:
    overlap = verdicts(summarise(_rounds(od=[20, 21, 22], eam=[19, 21.5, 23], oracle=[10, 10, 10])))[0]
    assert overlap["tpot"] == "within noise"
    assert overlap["tpot_ratio_verdict"] == "within noise"  # ratios 0.95 .. 1.045 straddle 1.02
    apart = verdicts(
        summarise(_rounds(od=[20, 21, 22], eam=[15, 16, 17], oracle=[10, 10, 10], eam_blocking=(3, 3, 3)))
    )[0]
    assert apart["tpot"] == "faster" and apart["tpot_ratio_verdict"] == "met"
    assert apart["blocking"] == "more"  # eam blocked 3 ms/token against on-demand's 2 in every round
    assert apart["gap_closed_verdict"] == "within noise"  # per round 0.5, 0.45, 0.42 (median TPOTs: 0.45)
    slower = verdicts(summarise(_rounds(od=[20, 20, 20], eam=[21, 22, 23], oracle=[10, 10, 10])))[0]
    assert slower["tpot"] == "slower" and slower["tpot_ratio_verdict"] == "not met"
    assert slower["gap_closed_verdict"] == "not met"


def test_target_and_compare_edges() -> None:
    assert target(0.9, 1.02, 1.02, at_most=True) == "met"  # the whole spread at or under the bound
    assert target(1.021, 1.3, 1.02, at_most=True) == "not met"
    assert target(0.5, 0.7, 0.5, at_most=False) == "met"
    assert target(0.2, 0.49, 0.5, at_most=False) == "not met"
    assert target(None, None, 0.5, at_most=False) == "n/a"
    assert compare(1, 2, 2, 3, "lower", "higher") == "within noise"  # touching spreads overlap
    assert compare(1, 1.9, 2, 3, "lower", "higher") == "lower"


def test_summarise_refuses_unmatched_rounds() -> None:
    rounds = _rounds(od=[20, 21, 22], eam=[19, 20, 21], oracle=[10, 10, 10])
    rounds[1] = rounds[1][:2]  # round 2 lost its oracle row
    with pytest.raises(ValueError, match="same"):
        summarise(rounds)
    a, b = summarise(_rounds(od=[20, 21, 22], eam=[19, 20, 21], oracle=[10, 10, 10]))[:2]
    assert paired(b, a, "tpot_ms", diff=True) == (-1.0, -1.0, -1.0)


def test_repeats_below_three_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "policies", "--repeats", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "moeserve: error: --repeats 2: must be >= 3 (median and spread of runs)"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"dataset": "d", "task": "t", "prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = ["bench", "policies", "--prompts", str(prompts), "--tasks", "1", "--warm", "1", "--eval", "2"]
    args += ["--batch", "2", "--new-tokens", "3", "--fractions", "0.25", "--policies", "eam,oracle"]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([*args, "--repeats", "3", "--json"]) == 0
    return json.loads(buf.getvalue())


def test_json_has_medians_spreads_settings_and_verdicts(small_run: dict) -> None:
    st, rows = small_run["settings"], small_run["results"]
    assert st["repeats"] == 3 and "round-robin" in st["order"] and "warmup" in st
    assert len(st["load_avg_before"]) == 3 and len(st["load_avg_after"]) == 3
    assert not Path(st["model"]).is_absolute()
    # the oracle pulls in on-demand+lru (it replays that run's accesses); all-resident is the reference
    assert {r["policy"] for r in rows} == {"all-resident", "on-demand+lru", "eam", "oracle"}
    for r in rows:
        for m in ("hit_rate", "blocking_ms_per_token", "bytes_per_token", "tpot_ms"):
            assert len(r["runs"][m]) == 3
            assert r[m + "_min"] <= r[m] <= r[m + "_max"]
            assert r[m + "_min"] == min(r["runs"][m]) and r[m + "_max"] == max(r["runs"][m])
    od = next(r for r in rows if r["policy"] == "on-demand+lru")
    oracle = next(r for r in rows if r["policy"] == "oracle")
    # no gap to close when a noisy 3-token run leaves the oracle no faster than on-demand
    assert od["gap_closed"] == (0.0 if oracle["tpot_ms"] < od["tpot_ms"] else None)
    assert od["tpot_vs_on_demand"] == 1.0
    eam = next(r for r in rows if r["policy"] == "eam")
    assert 0.0 <= eam["prefetch_on_share"] <= 1.0 and od["prefetch_on_share"] is None  # the eam trial
    shares = eam["arm_shares"]  # the trial's arms: prefetching, caching alone
    assert list(shares) == ["prefetch", "cache"] and od["arm_shares"] is None
    assert shares["prefetch"] == eam["prefetch_on_share"]
    (v,) = small_run["verdicts"]
    assert v["buffer_fraction"] == 0.25 and v["tpot_ratio_target"] == 1.02 and v["gap_closed_target"] == 0.5
    assert v["tpot"] in ("faster", "slower", "within noise")
    assert v["tpot_ratio_verdict"] in ("met", "not met", "within noise")
    md = render_policies(small_run)
    assert "| eam | " in md and "`repeats=3`" in md and "TPOT eam / on-demand" in md
    assert "| CPU ms/step | expert batches/step |" in md


def test_json_has_cpu_time_and_expert_batches_per_step(small_run: dict) -> None:
    """What TPOT is made of: the compute thread's CPU time per decode step (at most the step's
    wall time, which also holds its waits) and the expert batches it ran per step."""
    rows = {r["policy"]: r for r in small_run["results"]}
    layers = 8  # the bundled model's MoE layers
    for r in rows.values():
        assert len(r["runs"]["cpu_ms"]) == 3 and r["cpu_ms_min"] <= r["cpu_ms"] <= r["cpu_ms_max"]
        for cpu, tpot in zip(r["runs"]["cpu_ms"], r["runs"]["tpot_ms"], strict=True):
            assert 0 < cpu <= tpot * 1.05  # thread CPU time of the step within its wall time
    # every expert resident: one batch per MoE layer per step, exactly
    assert rows["all-resident"]["runs"]["expert_batches_per_step"] == [float(layers)] * 3
    # a 25% buffer: the misses land in batches of their own, so more batches than layers, and
    # the oracle's prefetches leave fewer of them than on-demand's misses
    od, oracle = rows["on-demand+lru"], rows["oracle"]
    assert od["expert_batches_per_step"] > layers
    assert oracle["expert_batches_per_step"] < od["expert_batches_per_step"]


def test_summarise_keeps_optional_figures_only_where_every_round_has_them() -> None:
    rounds = _rounds(od=[20.0, 22.0, 30.0], eam=[16.0, 23.1, 18.0], oracle=[10.0, 12.0, 14.0])
    for i, rnd in enumerate(rounds):
        for r in rnd:
            r.cpu_ms, r.expert_batches_per_step = 10.0 + i, 8.0 + 2 * i
    rounds[1][2].expert_batches_per_step = None  # an older result file's row
    rows = {r.policy: r for r in summarise(rounds)}
    assert (rows["eam"].cpu_ms, rows["eam"].cpu_ms_min, rows["eam"].cpu_ms_max) == (11.0, 10.0, 12.0)
    assert rows["eam"].runs["expert_batches_per_step"] == [8.0, 10.0, 12.0]
    assert rows["oracle"].cpu_ms == 11.0 and rows["oracle"].expert_batches_per_step is None
    assert "expert_batches_per_step" not in rows["oracle"].runs
