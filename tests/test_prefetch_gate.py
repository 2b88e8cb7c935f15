"""Cost-aware prefetching (``moe_runtime.prefetch.gate``): the terms follow what is observed, and
with nothing worth prefetching the ``eam`` policy is on-demand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_runtime.prefetch.gate_kernels as gate_kernels
from moe_runtime.prefetch.gate import PrefetchGate
from moe_runtime.prefetch.trial import ARMS, CLEAR_DIFF, MODES, ModeTrial
from moe_runtime.stats import ExpertStats
from tests.test_sim_engine import random_requests, sim_for


def _ranked(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positive entries of ``rows [D, E]`` as ``(row, column, rank)`` (``gate_kernels.ranked_free``
    with nothing held)."""
    return gate_kernels.ranked_free(
        np.ascontiguousarray(rows, dtype=np.float32), np.zeros(rows.shape, dtype=bool)
    )


def test_precision_follows_the_routing_by_distance_and_rank() -> None:
    gate = PrefetchGate(num_layers=4, num_experts=4, depth=2, decay=1.0, prior=(1.0, 2.0))
    gate.observe(0, np.array([[0, 1]]))
    rows = np.array([[0.6, 0.3, 0.1, 0.0], [0.0, 0.0, 0.5, 0.5]])  # layers 1 and 2, from layer 0
    r, c, rank = _ranked(rows)
    np.testing.assert_array_equal(rank, [0, 1, 2, 0, 1])
    gate.note(1, 1, np.stack([r, c, rank]))
    gate.observe(1, np.array([[0, 2]]))  # used: rank 0 (expert 0) and rank 2 (expert 2); not rank 1
    prec = gate.precision()
    assert prec[0, 0] == pytest.approx(2 / 3) and prec[0, 2] == pytest.approx(2 / 3)
    assert prec[0, 1] == pytest.approx(1 / 3)
    assert prec[1, 0] == pytest.approx(0.5)  # distance 2 not checked yet
    gate.observe(2, np.array([[3, 1]]))  # layer 2 used expert 3 (its rank 1), not expert 2 (rank 0)
    prec = gate.precision()
    assert prec[1, 0] == pytest.approx(1 / 3) and prec[1, 1] == pytest.approx(2 / 3)
    assert gate.checked == 5
    gate.note(1, 3, np.array([[0], [1], [0]]))
    gate.new_step()  # a finished step's unchecked candidates are dropped
    gate.observe(3, np.array([[1, 2]]))
    assert gate.checked == 5


def test_ranks_are_those_of_a_stable_descending_sort() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 4, size=(5, 9)).astype(np.float32) / 4  # ties and zeros
    r, c, rank = _ranked(rows)
    full = np.empty_like(rows, dtype=np.int64)
    np.put_along_axis(full, np.argsort(-rows, axis=1, kind="stable"), np.arange(9)[None, :], axis=1)
    np.testing.assert_array_equal(rank, full[r, c])
    assert (rows[r, c] > 0).all() and len(r) == (rows > 0).sum()


def test_link_terms_come_from_the_buffer_counters() -> None:
    gate = PrefetchGate(num_layers=2, num_experts=4, depth=1)
    stats = ExpertStats(2)
    gate.update_link(stats, 0.0, transfer_s=0.5)
    assert gate.block_per_miss_s is None and gate.demand_busy == 1.0  # nothing measured yet
    stats.demand_fetches[0] += 2
    stats.blocking_s[0] += 0.4
    gate.update_link(stats, 10.0, transfer_s=0.5)
    assert gate.block_per_miss_s == pytest.approx(0.2)  # 0.4 s over 2 misses
    assert gate.demand_busy == pytest.approx(0.8 * 1.0 + 0.2 * (2 * 0.5 / 10.0))


def test_pays_weighs_gain_against_link_and_eviction_cost() -> None:
    gate = PrefetchGate(num_layers=2, num_experts=4, depth=1)
    p = np.array([0.9, 0.4, 0.9, 0.0])
    reuse = np.array([0.0, 0.0, 0.9, 0.0])
    gate.block_per_miss_s, gate.demand_busy = 1.0, 0.5
    # gain 0.5 P against 0.5 (1 - P) + R: 0.45 > 0.05; 0.2 < 0.3; 0.45 < 0.95; 0 > 0.5 is false
    np.testing.assert_array_equal(gate.pays(p, 1.0, reuse)[0], [True, False, False, False])
    gate.idle_copies = 2.5  # the best two fit in idle link time: only the eviction counts for them
    np.testing.assert_array_equal(gate.pays(p, 1.0, reuse)[0], [True, True, False, False])
    gate.idle_copies = 0.0
    gate.demand_busy = 0.0  # an idle link: only the eviction counts
    np.testing.assert_array_equal(gate.pays(p, 1.0, reuse)[0], [True, True, False, False])
    gate.demand_busy = 1.0  # demand keeps the link busy: a prefetch only moves a copy ahead
    assert not gate.pays(np.ones(4), 1.0, np.zeros(4))[0].any()
    gate.demand_busy, gate.block_per_miss_s = 0.5, 0.0  # fetches never block: nothing to gain
    assert not gate.pays(np.ones(4), 1.0, np.zeros(4))[0].any()


def _precision_held_at(value: float):  # noqa: ANN202
    """``PrefetchGate.plan_state`` with the precision the plan reads held at ``value`` (a copy of
    the figures: the plan's scoring does not move it)."""

    def plan_state(self):  # noqa: ANN001, ANN202
        figures = self._figures.copy()
        figures[2] = value
        return figures, self._noted, self._noted_n

    return plan_state


def test_eam_with_zero_precision_is_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = sim_for(layers=3, experts=6, slots=6, batch=2)
    reqs = random_requests(3, 8, 3, 6, 2, 8)
    monkeypatch.setattr(PrefetchGate, "plan_state", _precision_held_at(0.0))
    gated = sim.run("eam", "lru", reqs[:4], reqs[4:])
    base = sim.run("on-demand", "lru", reqs[:4], reqs[4:])
    assert gated.stats["prefetch_issued"] == 0
    assert gated.tpot_s == base.tpot_s and gated.stats["hits"] == base.stats["hits"]
    monkeypatch.setattr(PrefetchGate, "plan_state", _precision_held_at(1.0))
    assert sim.run("eam", "lru", reqs[:4], reqs[4:]).stats["prefetch_issued"] > 0  # the same run, gate open


def test_a_plan_must_win_back_its_host_time_and_a_fast_link_closes_the_gate() -> None:
    gate = PrefetchGate(num_layers=2, num_experts=4, depth=1)
    gate.block_per_miss_s, gate.demand_busy = 1e-3, 0.0  # each sure prefetch saves 1 ms
    p, reuse = np.ones(2), np.zeros(2)
    keep, plan_on = gate.pays(p, 1e-3, reuse)
    assert keep.all() and plan_on and gate.host_s == 0.0  # not timed: the simulator
    for _ in range(50):
        gate.note_host_time(3e-3)  # planning costs 3 ms, more than the 2 ms the plan saves
    assert gate.host_s == pytest.approx(3e-3, rel=1e-3)
    keep, plan_on = gate.pays(p, 1e-3, reuse)
    assert keep.all() and not plan_on  # the spent plan's paying candidates go; planning stops
    assert gate.pays(np.ones(4), 1e-3, np.zeros(4))[1]  # 4 ms saved: worth its 3 ms
    gate.block_per_miss_s = 1e-6  # a fast link: a miss barely blocks, planning never pays
    keep, plan_on = gate.pays(np.ones(64), 1e-6, np.zeros(64))
    assert not plan_on
    gate.force_open = True  # bench overhead's forced-open gate issues whatever the test says
    keep, plan_on = gate.pays(np.ones(4), 1e-6, np.ones(4))
    assert keep.all() and plan_on


def test_idle_link_time_is_measured_in_copies_per_planning_layer() -> None:
    """A step of 10 ms whose 20 demand copies of 0.25 ms kept the link busy for 5 ms leaves 5 ms
    idle: 20 copies over the 4 planning layers of a 5-layer model, 5 per layer."""
    from types import SimpleNamespace

    gate = PrefetchGate(num_layers=5, num_experts=4, depth=1)
    stats = SimpleNamespace(total_blocking_s=0.0, demand_fetches=[0], late_prefetches=[0])
    gate.update_link(stats, 0.0, 2.5e-4)
    for step in range(1, 60):
        stats.demand_fetches = [20 * step]
        gate.update_link(stats, 0.01 * step, 2.5e-4)
    assert gate.idle_copies == pytest.approx(5.0, rel=1e-3)
    assert gate.demand_busy == pytest.approx(0.5, rel=1e-3)
    stats.demand_fetches = [20 * 59 + 80]  # a step whose demand copies filled the link
    for _ in range(60):
        stats.demand_fetches[0] += 40
        gate.update_link(stats, gate._last[0] + 0.01, 2.5e-4)
    assert gate.idle_copies < 0.01
    # a right prefetch in idle link time saves one copy of the next layer's wait, at most
    # what a layer blocks and at least the mean blocking per miss
    gate.block_per_miss_s, gate.block_per_layer_s = 1e-5, 1e-3
    assert gate.idle_save(2.5e-4) == 2.5e-4
    gate.block_per_layer_s = 1e-4
    assert gate.idle_save(2.5e-4) == 1e-4
    gate.block_per_layer_s = 0.0
    assert gate.idle_save(2.5e-4) == 1e-5


def _drive(trial: ModeTrial, cost: dict[bool, float], steps: int, prefill_every: int = 0) -> list[bool]:
    """Run ``steps`` steps that cost ``cost[mode]`` (a prefill step every ``prefill_every`` steps
    costs 10x and must not count); returns the mode of every step."""
    modes = []
    for i in range(steps):
        prefill = prefill_every > 0 and i % prefill_every == 0
        modes.append(trial.on)
        trial.end_step(cost[trial.on] * (10 if prefill else 1), decode_only=not prefill)
    return modes


def test_mode_trial_turns_prefetching_off_when_it_costs_more_and_keeps_exploring() -> None:
    trial = ModeTrial(window=2, explore_every=4, first_pairs=2, max_backoff=0)
    modes = _drive(trial, {True: 0.012, False: 0.010}, 200, prefill_every=25)
    assert trial.diff == pytest.approx(2 * (0.012 - 0.010) / 0.022)
    late = modes[100:]
    assert 0.1 < sum(late) / len(late) < 0.4  # mostly on-demand; every 4th window explores
    trial = ModeTrial(window=2, explore_every=4, first_pairs=2, max_backoff=0)
    modes = _drive(trial, {True: 0.008, False: 0.010}, 200)
    assert trial.diff < 0 and 0.6 < sum(modes[100:]) / 100 < 0.9  # prefetching pays
    with pytest.raises(ValueError, match="window"):
        ModeTrial(window=0)


def test_the_trial_runs_only_in_the_runtime_and_follows_the_load() -> None:
    sim = sim_for(layers=3, experts=6, slots=6, batch=2)
    state = sim.make_state("eam", "lru")
    assert state.prefetcher.trial is None and not state.prefetcher._timed  # the simulator's clock
    trial = ModeTrial(window=1, explore_every=8, first_pairs=1, settle=1, max_backoff=0)
    assert sum(_drive(trial, {True: 0.010, False: 0.020}, 40)[20:]) >= 15  # mostly prefetching
    modes = _drive(trial, {True: 0.030, False: 0.020}, 80)  # the host changed: prefetching costs more
    assert sum(modes[40:]) <= 10


def _decode(path, prefetch: str, arm: str | None) -> tuple[list[list[int]], int, int, int]:
    """Greedy tokens of two prompts, with the eam trial pinned to ``arm`` (None: as it is);
    returns (tokens, lookahead computations, plans, prefetches issued)."""
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams

    rt = RuntimeConfig(buffer_slots=3, max_batch_size=2, max_model_len=64, prefetch_policy=prefetch)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLMEngine.from_pretrained(path, rt) as engine:
        pf, computed = engine.prefetcher, [0]
        if arm is not None:
            pf.trial = ModeTrial(arms=MODES)  # every mode, lean included
            pf.set_arm(arm)
            pf.trial.arm = pf.trial.arms.index(arm)
            pf.trial.end_step = lambda *step: False  # keep the arm
            assert all(part.policy.lru == (arm == "lean") for part in engine.buffer.parts)
        la = engine.model.lookahead
        if la is not None:  # lookahead scores computed (None: not wanted, no work)
            scores = la.scores

            def counted(*a, **k):
                out = scores(*a, **k)
                computed[0] += out is not None
                return out

            la.scores = counted
        for i, prompt in enumerate([[1, 2, 3, 4], [5, 6, 7]]):
            engine.add_request(f"r{i}", prompt, params)
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.output_token_ids
        issued = engine.buffer.stats.prefetch_issued
        return [done[k] for k in sorted(done)], computed[0], getattr(pf, "plans", 0), issued


def test_with_prefetching_off_the_compute_thread_neither_plans_nor_looks_ahead(tiny_qwen3) -> None:
    tokens = _decode(tiny_qwen3, "on-demand", None)[0]
    for arm in ("lean", "cache"):  # on-demand + LRU, and caching alone: no host work for plans
        assert _decode(tiny_qwen3, "eam", arm) == (tokens, 0, 0, 0)
    tokens_on, computed_on, plans_on, _ = _decode(tiny_qwen3, "eam", "prefetch")
    assert tokens_on == tokens and computed_on > 0 and plans_on > 0  # the same run, prefetching on
    with pytest.raises(ValueError, match="arm"):
        _decode(tiny_qwen3, "eam", "sometimes")


def test_a_lean_eam_reuse_cache_is_lru() -> None:
    from moe_runtime.buffer.policies import EAMReuseCachePolicy
    from tests.test_policies import FakeRecorder

    eam = np.zeros((2, 4))
    eam[1, 3] = 5.0  # the batch keeps using expert 3 of layer 1
    policy = EAMReuseCachePolicy(3, 4, num_layers=2, recorder=FakeRecorder(eam))
    for slot, key in enumerate((7, 1, 2)):  # layer 1 expert 3, layer 0 experts 1 and 2
        policy.on_fill(slot, key, prefetch=False)
    policy.after_routing(0, ["a"], np.array([[0]]))
    assert policy.victim(np.array([0, 1, 2])) != 0  # loop-aware: keeps the expert in use
    policy.lru = True
    policy.after_routing(0, ["a"], np.array([[0]]))
    assert policy.victim(np.array([0, 1, 2])) == 0  # LRU: the least recently filled
    policy.on_use(0, 7)
    assert policy.victim(np.array([0, 1, 2])) == 1


def test_a_clear_difference_is_explored_less_often() -> None:
    close, clear = (ModeTrial(window=1, explore_every=4, settle=1, max_backoff=0) for _ in range(2))
    on_close = sum(_drive(close, {True: 0.011, False: 0.010}, 400)[100:])
    on_clear = sum(_drive(clear, {True: 0.030, False: 0.010}, 400)[100:])  # diff 1.0 > CLEAR_DIFF
    assert clear.diff > CLEAR_DIFF > close.diff > 0
    assert 0 < on_clear < on_close / 2  # both still explore; the clear case 4x less often


def test_steps_after_a_switch_do_not_count_so_the_cache_carried_over_biases_nothing() -> None:
    """For ``carry`` steps after a switch a step still costs what the other mode's buffer makes
    it cost (here on-demand inherits prefetching's cheap steps): counted, they bias the trial
    towards on-demand; with ``settle >= carry`` the measured difference is the steady one."""

    def run(settle: int, carry: int = 3) -> ModeTrial:
        trial = ModeTrial(window=2, explore_every=4, first_pairs=2, settle=settle)
        cost, since = {True: 0.009, False: 0.010}, 10**6  # no switch before the first step
        for _ in range(400):
            mode = trial.on
            since = since + 1
            c = cost[not mode] if since <= carry else cost[mode]
            if trial.end_step(c, decode_only=True):
                since = 0
        return trial

    steady = 2 * (0.009 - 0.010) / 0.019
    assert run(settle=3).diff == pytest.approx(steady)
    assert run(settle=1).diff > steady / 2  # the carried-over steps hid most of the difference
    with pytest.raises(ValueError, match="settle"):
        ModeTrial(settle=0)


def test_confirmed_explorations_back_off_and_a_change_is_still_followed() -> None:
    def on_steps(max_backoff: int) -> tuple[int, ModeTrial]:
        trial = ModeTrial(window=1, explore_every=4, first_pairs=1, settle=1, max_backoff=max_backoff)
        return sum(_drive(trial, {True: 0.011, False: 0.010}, 600)[100:]), trial

    base, _ = on_steps(0)
    backed, trial = on_steps(3)
    assert 0 < backed < base / 3  # explorations confirming on-demand grow 2x rarer each, up to 8x
    # the host changes: prefetching pays now; found within 8 x 4 windows, then chosen
    modes = _drive(trial, {True: 0.008, False: 0.010}, 200)
    assert sum(modes[100:]) > 80
    with pytest.raises(ValueError, match="max_backoff"):
        ModeTrial(max_backoff=-1)


def _drive_arms(trial: ModeTrial, cost: list[float], steps: int, prefill_every: int = 0) -> list[int]:
    """:func:`_drive` by arm: a step of arm ``a`` costs ``cost[a]``; returns the arm of every step."""
    arms = []
    for i in range(steps):
        prefill = prefill_every > 0 and i % prefill_every == 0
        arms.append(trial.arm)
        trial.end_step(cost[trial.arm] * (10 if prefill else 1), decode_only=not prefill)
    return arms


@pytest.mark.parametrize("best", [0, 1, 2])
def test_three_arms_the_cheapest_runs_and_the_others_are_still_explored(best: int) -> None:
    cost = [0.010, 0.010, 0.010]
    cost[best] = 0.008
    cost[(best + 1) % 3] = 0.011
    trial = ModeTrial(window=2, explore_every=4, first_pairs=2, max_backoff=0, arms=MODES)
    arms = _drive_arms(trial, cost, 600, prefill_every=50)
    assert int(np.argmin(trial.scores())) == best
    late = arms[200:]
    others = [late.count(a) for a in range(3) if a != best]
    assert late.count(best) > 2 * max(others) and min(others) > 0  # the others explored in turn
    assert trial.decode_steps_by_arm[best] == max(trial.decode_steps_by_arm)
    assert (trial.pair_counts[-1, :-1] >= 2).all()  # each other arm was paired with the reference


def test_a_barred_arm_is_neither_chosen_nor_explored_until_it_is_allowed_again() -> None:
    trial = ModeTrial(window=1, explore_every=4, first_pairs=1, settle=1, arms=MODES)
    trial.bar("prefetch", True)  # e.g. a step blocks for less than its plans would cost
    arms = _drive_arms(trial, [0.005, 0.010, 0.011], 300)  # prefetching would be cheapest
    assert 0 not in arms[5:] and arms[100:].count(1) > 150  # caching alone, the cheapest allowed
    trial.bar("prefetch", False)
    arms = _drive_arms(trial, [0.005, 0.010, 0.011], 600)
    assert arms[300:].count(0) > 200  # measured once allowed, and chosen
    with pytest.raises(ValueError, match="never barred"):
        trial.bar("lean", True)
    with pytest.raises(ValueError, match="cannot bar"):
        trial.bar("sometimes", True)


class CountingClock:
    """A run clock (``prefetch.run_clock``) that counts its run-delay reads."""

    def __init__(self) -> None:
        self.reads = 0

    def delay(self) -> float:
        self.reads += 1
        return 0.0

    @staticmethod
    def wall() -> float:
        return 0.0


def test_a_trial_with_every_other_arm_barred_rests_and_measures_afresh_once_unbarred() -> None:
    """While only the reference arm is allowed no pair can form: the caller skips measuring
    (``settled``) and reports the step with ``rest``; once another arm is allowed again, the
    first window is measured from scratch (the step after the rest is not counted)."""
    trial = ModeTrial(window=2, explore_every=4, first_pairs=1, settle=1, arms=("prefetch", "cache"))
    assert not trial.settled  # the first window prefetches
    _drive_arms(trial, [0.010, 0.010], 12)
    trial.bar("prefetch", True)
    _drive_arms(trial, [0.010, 0.010], 6)  # the current window ends: caching alone from then on
    assert trial.arm_name == "cache" and trial.settled
    steps = trial.decode_steps_by_arm[1]
    trial.end_step(0.01, decode_only=True)  # a window is open
    for _ in range(5):
        trial.rest(decode_only=True)
    assert trial.decode_steps_by_arm[1] == steps + 6 and trial._n == 0 and trial._prev is None
    trial.bar("prefetch", False)
    assert not trial.settled
    assert not trial.end_step(0.01, decode_only=True)  # not counted: the measuring restarts
    assert trial._n == 0
    trial.end_step(0.01, decode_only=True)
    assert trial._n == 1


def test_eam_reads_no_run_clock_while_prefetching_is_barred() -> None:
    """With prefetching barred and the trial caching alone, a decode step's end reads only the
    buffer's counters (the run delay's pread cost about 16 us a step), and the bar is still
    weighed: once steps block long enough it lifts and the steps are measured again."""
    from test_policies import fake_eam_policy, small_store

    from moe_runtime.buffer import ExpertBuffer

    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        pol = fake_eam_policy(buf, np.ones((4, 5)), lookahead=1)
        pol._run_clock = clock = CountingClock()
        pol.set_arm("cache")
        pol.trial.arm = pol.trial.reference
        pol.gate.host_s = 1e-3  # a planning layer costs 1 ms: 3 ms per step of 4 layers
        pol._bar_prefetch(1e-4)
        assert pol.trial.settled
        for _ in range(5):
            pol.end_step()
        assert clock.reads == 0 and pol.trial.decode_steps_by_arm[1] == 5
        pol.gate.host_s = 0.0  # plans cost nothing now: nothing bars prefetching
        pol.end_step()  # the bar is weighed, and lifts
        assert not pol.trial.barred[0]
        pol.end_step()
        assert clock.reads == 1  # measured again
    finally:
        buf.close()


def test_a_pinned_arm_holds_whatever_the_steps_cost() -> None:
    """``EAMPrefetch.pin`` holds the policy in one arm for measurements: no step is measured
    (no run delay read), the prefetch bar is not weighed, the trial counts nothing, and the
    policy is idle exactly for the arms without plans; the cache evicts LRU in ``lean`` alone."""
    from test_policies import FakeRecorder, fake_eam_policy, small_store

    from moe_runtime.buffer import ExpertBuffer

    context = {"recorder": FakeRecorder(np.ones((4, 5)))}
    cpu = [torch.device("cpu")]
    link = (1e-7, 0.0)
    buf = ExpertBuffer(small_store(), cpu, 12, link=link, cache_policy="eam-reuse", policy_context=context)
    try:
        pol = fake_eam_policy(buf, np.ones((4, 5)), lookahead=1)
        pol._run_clock = clock = CountingClock()
        for arm in ("lean", "cache", "prefetch"):
            pol.pin(arm)
            assert pol.idle == (arm != "prefetch")
            assert buf.parts[0].policy.lru == (arm == "lean")
            pol.gate.host_s = 1e-3  # plans would cost 3 ms a step: unpinned, a cheap step bars them
            for _ in range(40):
                pol.end_step()
            assert clock.reads == 0 and not any(pol.trial.barred) and pol.trial.decode_steps == 0
        with pytest.raises(ValueError, match="sometimes"):
            pol.pin("sometimes")
    finally:
        buf.close()


def test_three_arms_a_cost_that_falls_within_each_batch_favours_no_arm() -> None:
    """A batch's early decode steps cost more under every arm (its experts are not cached
    yet), and a step whose batch needs more distinct experts costs more under every arm: the
    trial measures each arm before and after the first one and divides by the steps' lookups,
    so the truly cheaper arm (10% here) is still found. (Without the lookups, 16 of 60 such
    runs chose wrong.)"""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        for best in range(3):
            cost = [1.0, 1.0, 1.0]
            cost[best] = 0.9
            trial = ModeTrial(window=2, explore_every=4, first_pairs=3, settle=2, arms=MODES)
            for i in range(1500):
                at = i % 23  # a new batch (prefill) every 23 steps; the cost halves over a batch
                lookups = int(rng.integers(5, 20))
                step = 1e-3 * cost[trial.arm] * (2.0 - at / 22) * lookups
                trial.end_step(step, decode_only=at != 0, work=lookups)
            assert int(np.argmin(trial.scores())) == best, (seed, best, trial.scores())


def test_three_arms_follow_a_change_of_the_cheapest() -> None:
    trial = ModeTrial(window=1, explore_every=4, first_pairs=1, settle=1, arms=MODES)
    _drive_arms(trial, [0.012, 0.009, 0.010], 300)
    assert trial.arm_name == "cache" or int(np.argmin(trial.scores())) == 1
    arms = _drive_arms(trial, [0.012, 0.011, 0.008], 600)  # the host changed: LRU is cheapest now
    assert arms[300:].count(2) > 200
    with pytest.raises(ValueError, match="two arms"):
        ModeTrial(arms=("prefetch",))


def test_eam_bars_prefetching_while_steps_block_less_than_their_plans_would_cost() -> None:
    from test_policies import fake_eam_policy, small_store

    from moe_runtime.buffer import ExpertBuffer

    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        pol = fake_eam_policy(buf, np.ones((4, 5)), lookahead=1)
        pol._bar_prefetch(1e-4)
        assert not pol.trial.barred[0]  # no plan timed yet: nothing to weigh
        pol.gate.host_s = 1e-3  # a planning layer costs 1 ms: 3 ms per step of 4 layers
        pol._bar_prefetch(1e-4)
        assert pol.trial.barred[0]  # 0.1 ms of blocking cannot pay for it
        for _ in range(20):
            pol._bar_prefetch(0.02)  # the load changed: steps block 20 ms
        assert not pol.trial.barred[0]
    finally:
        buf.close()


def test_one_cold_plan_cannot_hold_the_host_time_up_and_an_unmeasured_figure_fades() -> None:
    """The runtime's first plan (a prefill layer, cold) took 8.4 ms against 0.26 ms for a decode
    layer's: unclipped, that one sample kept the mean 3x too high and prefetching barred."""
    from moe_runtime.prefetch.gate import HOST_CLIP, HOST_FORGET, LINK_DECAY

    gate = PrefetchGate(num_layers=2, num_experts=4, depth=1)
    gate.note_host_time(3e-4)
    gate.note_host_time(8.4e-3)  # one cold or preempted plan
    assert gate.host_s == pytest.approx(LINK_DECAY * 3e-4 + (1 - LINK_DECAY) * HOST_CLIP * 3e-4)
    for _ in range(15):
        gate.note_host_time(3e-4)
    assert gate.host_s < 3.1e-4  # back within 15 plans (unclipped: 0.36 ms)
    for _ in range(5):
        gate.note_host_time(3e-3)  # the load really changed: the mean follows, if clipped
    assert gate.host_s > 1e-3
    before = gate.host_s
    for _ in range(347):  # decode steps without plans: nothing re-measures it
        gate.forget_host_time()
    assert gate.host_s == pytest.approx(before * HOST_FORGET**347) and gate.host_s < 0.51 * before


def test_eam_times_only_decode_plans_and_a_bar_lifts_once_its_figure_faded() -> None:
    from test_policies import fake_eam_policy, small_store

    from moe_runtime.buffer import ExpertBuffer

    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        pol = fake_eam_policy(buf, np.ones((4, 5)), lookahead=1, probe_every=1)  # every layer plans
        assert pol._timed and pol.trial is not None
        pol.plan_timed = True  # the runtime measures a random HOST_SAMPLE of its plans: these two
        pol.after_routing(0, ["a"], np.array([[0, 1], [2, 3], [1, 4]]))  # a prefill layer: 3 tokens
        assert pol.plans == 1 and pol.gate.host_s == 0.0  # planned, not timed
        pol.plan_timed = True
        pol.after_routing(1, ["a"], np.array([[0, 1]]))  # a decode layer
        assert pol.plans == 2 and pol.gate.host_s > 0.0
        pol.gate.host_s = 1e-3  # a planning layer costs 1 ms: 3 ms per step of 4 layers
        pol._bar_prefetch(2e-3)
        assert pol.trial.barred[0]  # 2 ms of blocking cannot pay for it
        steps = 1
        while pol.trial.barred[0] and steps < 1000:
            pol._bar_prefetch(2e-3)  # the same load: only the unmeasured figure fades
            steps += 1
        assert 150 < steps < 260  # lifted (1 ms x 0.998^n x 3 < 2 ms): the trial may time plans again
    finally:
        buf.close()


def test_two_arms_the_cheaper_runs_and_the_other_is_still_explored() -> None:
    """The ``eam`` policy's default trial: prefetching against caching alone (the reference)."""
    for best in (0, 1):
        cost = [0.010, 0.010]
        cost[best] = 0.008
        trial = ModeTrial(arms=ARMS)  # the policy's defaults
        arms = _drive_arms(trial, cost, 1200, prefill_every=50)
        assert int(np.argmin(trial.scores())) == best
        late = arms[300:]
        assert late.count(best) > 5 * late.count(1 - best) > 0


def test_the_eam_trial_runs_prefetching_and_caching_alone_unless_told_otherwise() -> None:
    from moe_runtime.buffer import ExpertBuffer
    from moe_runtime.errors import ConfigError
    from tests.test_policies import E, L, fake_eam_policy, small_store

    eam = np.ones((L, E))
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 8)
    try:
        assert fake_eam_policy(buf, eam).trial.arms == ARMS == ("prefetch", "cache")
        assert fake_eam_policy(buf, eam, trial_arms=MODES).trial.arms == ("prefetch", "cache", "lean")
        for bad in (("cache", "lean"), ("prefetch",), ("prefetch", "lean", "cache"), ("prefetch", "lru")):
            with pytest.raises(ConfigError, match="trial arms"):
                fake_eam_policy(buf, eam, trial_arms=bad)
    finally:
        buf.close()
