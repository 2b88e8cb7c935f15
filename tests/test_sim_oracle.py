"""Property: the oracle (perfect prefetch + Belady, MoE-Infinity Table 5's "Ideal") is never beaten.

The property is stated where it holds by construction: copies are instantaneous next to compute,
so a hit is purely a caching question, and the buffer holds at least the experts one layer
execution needs (no expert streams through a slot within a layer, where the compute order, not
the policy, picks the victim). With a slow link the oracle is not an upper bound on *hit rate*:
its prefetch can still be in flight when the layer runs (a late prefetch counts as a miss) where
a cache-only policy happened to keep the expert (see ``docs/simulator.md``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_runtime.prefetch.oracle import OracleSchedule
from moeserve.sim.cost import CostModel
from moeserve.sim.engine import SimConfig, Simulator
from moeserve.sim.runner import SIM_COMBOS as COMBOS
from moeserve.sim.runner import run_combos
from moeserve.sim.workload import SimRequest


@st.composite
def traces(draw: st.DrawFn) -> tuple[Simulator, list[SimRequest]]:
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 8))
    top_k = draw(st.integers(1, min(3, experts)))
    batch = draw(st.integers(1, 3))
    reqs = []
    for i in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 7))
        ids = [[draw(st.permutations(range(experts)))[:top_k] for _ in range(layers)] for _ in range(rows)]
        arr = np.asarray(ids, dtype=np.int64)  # [T, L, k]
        prefill = draw(st.integers(0, rows - 1))
        reqs.append(SimRequest(f"r{i}", None, arr, np.ones(arr.shape, np.float32), prefill))
    widest = min(experts, top_k * batch * max(r.num_rows for r in reqs))  # most experts of one layer run
    slots = draw(st.integers(widest, layers * experts))
    cost = CostModel.measured(
        transfer_s=1e-9,
        expert_a_s=draw(st.floats(0.01, 1.0)),
        expert_b_s=0.001,
        layer_fixed_s=draw(st.floats(0.0, 1.0)),
        layer_b_s=0.0,
        step_fixed_s=0.1,
    )
    return Simulator(layers, experts, top_k, 100, cost, SimConfig(slots=slots, batch=batch)), reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_oracle_hit_rate_is_never_below_another_policy(case: tuple[Simulator, list[SimRequest]]) -> None:
    sim, reqs = case
    runs = run_combos(sim, list(COMBOS), [], reqs)
    oracle = next(r for r in runs if r.prefetch == "oracle")
    for r in runs:
        assert oracle.hit_rate >= r.hit_rate - 1e-12, (r.label, r.hit_rate, oracle.hit_rate)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), max_size=4).map(tuple)), max_size=12),
    st.integers(0, 13),
    st.integers(0, 6),
    st.integers(0, 2),
)
def test_oracle_first_uses_are_the_first_upcoming_entry_of_each_key(
    log: list[tuple[int, tuple[int, ...]]], cursor: int, horizon: int, start: int
) -> None:
    sched = OracleSchedule(log, 6)
    sched.cursor = cursor
    seen: set[int] = set()
    expected = []
    for d, key in sched.upcoming(horizon, start):
        if key not in seen:
            seen.add(key)
            expected.append((d, key))
    dist, keys = sched.first_uses(horizon, start)
    assert list(zip(dist.tolist(), keys.tolist())) == expected
