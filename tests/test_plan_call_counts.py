"""CPU-checkable proxies for a planning layer's host work (``bench overhead`` budgets 50 us of host
work per MoE layer): how many compiled calls a plan makes, and which of them run once per step
rather than once per plan."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

import moe_runtime.prefetch.eam as eam
import moe_runtime.prefetch.eam_kernels as eam_kernels
import moe_runtime.prefetch.gate_kernels as gate_kernels
import moe_runtime.prefetch.gating as gating
from moe_runtime.io.transfer_queue import TransferQueue
from moe_runtime.prefetch.gate import PrefetchGate
from moe_runtime.prefetch.term_value import TermValue
from tests.test_sim_engine import random_requests, sim_for


class _NeverTerm(TermValue):
    """The EAMC term weighed and never wanted: plans predict from the own term (and lookahead)."""

    def wanted(self, block_s: float) -> bool:
        self.skipped += 1
        return False


def _counted_run(monkeypatch: pytest.MonkeyPatch, skip_term: bool) -> tuple[Counter, int]:
    """Counts of the compiled calls of a simulated ``eam`` run with the gate forced open (every
    layer plans, tests and issues), and the number of engine steps."""
    calls: Counter = Counter()

    def count(owner, name, key=None):  # noqa: ANN001
        fn = getattr(owner, name)

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[key or name] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    count(gate_kernels, "limit_gate_plan")
    own_plus_eamc = eam_kernels.own_plus_eamc

    def own_alone(own, eamc):  # noqa: ANN001, ANN202
        calls["own alone" if eamc.shape[0] == 0 else "own + eamc"] += 1
        return own_plus_eamc(own, eamc)

    monkeypatch.setattr(eam_kernels, "own_plus_eamc", own_alone)
    count(TransferQueue, "replan_ranked")
    inner, steps = eam.EAMPrefetch._plan, [0]

    def plan(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls["plans"] += 1
        state = self._use_state
        sorted_before = bool(state[1])
        scored = inner(self, *args)
        calls["sorts"] += int(state[1] and not sorted_before)
        return scored

    monkeypatch.setattr(eam.EAMPrefetch, "_plan", plan)
    end_step = eam.EAMPrefetch.end_step

    def counted_end(self):  # noqa: ANN001, ANN202
        steps[0] += 1
        end_step(self)

    monkeypatch.setattr(eam.EAMPrefetch, "end_step", counted_end)
    init, gate_init = eam.EAMPrefetch.__init__, PrefetchGate.__init__

    def init_weighed(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        init(self, *args, **kwargs)
        if skip_term:
            self.eamc_term = _NeverTerm()

    def open_gate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate_init(self, *args, **kwargs)
        self.force_open = True

    monkeypatch.setattr(eam.EAMPrefetch, "__init__", init_weighed)
    monkeypatch.setattr(PrefetchGate, "__init__", open_gate)
    reqs = random_requests(3, 30, 6, 16, 2, 6)
    sim = sim_for(layers=6, experts=16, slots=24, batch=3)
    # the router lookahead on, as the runtime's default: plans cover the next layer only
    sim.config = replace(sim.config, lookahead_precision=(0.6,))
    sim.run("eam", "eam-reuse", reqs[:20], reqs[20:])
    return calls, steps[0]


@pytest.mark.parametrize("skip_term", [False, True])
def test_a_plan_makes_one_gate_call_and_one_queue_call(
    monkeypatch: pytest.MonkeyPatch, skip_term: bool
) -> None:
    calls, steps = _counted_run(monkeypatch, skip_term)
    plans = calls["plans"]
    assert plans > 5 * steps > 0  # the gate is open: (nearly) every layer plans
    # after its prediction a plan makes one compiled gate call and, issuing, one queue call
    assert calls["limit_gate_plan"] <= plans
    assert 0 < calls["replan_ranked"] <= plans
    # the victims' next-step use is sorted at most once per step
    assert calls["sorts"] <= steps
    # the own term alone (plans without the EAMC term; the simulator's when the EAMC has no
    # match) is normalised once per step for every row, not once per plan
    assert calls["own alone"] <= steps
    if skip_term:  # decode plans leave the term out; only prefill plans, which always compute it, have it
        assert calls["own alone"] > 0 and calls["own + eamc"] < steps
    else:
        assert calls["own + eamc"] > steps


def test_the_host_clock_is_read_at_a_sample_of_the_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime measures a plan's host time (thread CPU time, a system call per read) at about
    ``HOST_SAMPLE`` of its planning layers only: two reads per measured plan (three or four with
    the EAMC term), none at the others, and the gate's running mean is fed only by those."""
    reads, noted, plans = [0], [0], [0]

    class _Clock:
        @staticmethod
        def thread_time() -> float:
            reads[0] += 1
            return 0.001 * reads[0]

    monkeypatch.setattr(eam, "time", _Clock)  # the EAMC term's host time
    monkeypatch.setattr(gating, "time", _Clock)  # the plan's
    init, inner = eam.EAMPrefetch.__init__, eam.EAMPrefetch._plan

    def init_timed(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        init(self, *args, **kwargs)
        self._timed = True  # as in the runtime (the simulator's clock is not the host's)
        self.eamc_term = TermValue(self.probe_every)
        note = self.gate.note_host_time

        def counted(seconds: float) -> None:
            noted[0] += 1
            note(seconds)

        self.gate.note_host_time = counted

    def plan(self, *args):  # noqa: ANN001, ANN002, ANN202
        plans[0] += 1
        return inner(self, *args)

    monkeypatch.setattr(eam.EAMPrefetch, "__init__", init_timed)
    monkeypatch.setattr(eam.EAMPrefetch, "_plan", plan)
    monkeypatch.setattr(PrefetchGate, "plans_pay", lambda self, net: True)  # plan every layer
    reqs = random_requests(3, 30, 6, 16, 2, 6)
    sim = sim_for(layers=6, experts=16, slots=24, batch=3)
    sim.config = replace(sim.config, lookahead_precision=(0.6,))
    sim.run("eam", "eam-reuse", reqs[:20], reqs[20:])
    assert plans[0] > 200
    assert 0 < noted[0] <= reads[0] // 2
    # about HOST_SAMPLE of the plans are measured: m of them make 2 m reads, and at most 2 m more
    # with the EAMC term (so reads / 2 / plans lies in [m, 2 m] / plans; 0.25 is binomial noise)
    share = reads[0] / 2 / plans[0]
    assert gating.HOST_SAMPLE * 0.75 < share < gating.HOST_SAMPLE * 2.25, (share, plans[0], noted[0])
