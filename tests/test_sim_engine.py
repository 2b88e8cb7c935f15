"""Simulator: it drives the runtime's own classes, counts consistently, is deterministic, and
its timing matches hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from moe_runtime.buffer.partition import Partition
from moe_runtime.io.transfer_queue import TransferQueue
from moeserve.sim.cost import CostModel
from moeserve.sim.engine import SimConfig, Simulator
from moeserve.sim.runner import SIM_COMBOS as COMBOS
from moeserve.sim.runner import run_combos
from moeserve.sim.workload import SimRequest


def random_requests(
    seed: int, n: int, layers: int, experts: int, top_k: int, tokens: int
) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(2, tokens + 1))
        ids = np.stack(
            [np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]) for _ in range(t)]
        )
        prefill = int(rng.integers(0, t))
        out.append(
            SimRequest(f"r{i}", f"task{i % 2}", ids.astype(np.int64), np.ones(ids.shape, np.float32), prefill)
        )
    return out


def sim_for(layers: int = 3, experts: int = 6, top_k: int = 2, slots: int = 5, batch: int = 2) -> Simulator:
    cost = CostModel.measured(
        transfer_s=1.0, expert_a_s=0.2, expert_b_s=0.01, layer_fixed_s=0.3, layer_b_s=0.0, step_fixed_s=0.1
    )
    return Simulator(layers, experts, top_k, 1000, cost, SimConfig(slots=slots, batch=batch))


def test_runs_the_runtime_policy_classes() -> None:
    sim = sim_for()
    reqs = random_requests(0, 4, 3, 6, 2, 6)
    log = sim.run("on-demand", "lru", [], reqs, record_log=True).access_log
    for _, prefetch, cache in COMBOS:
        state = sim.make_state(prefetch, cache, log if "oracle" in (prefetch, cache) else None)
        assert type(state.prefetcher).__module__.startswith("moe_runtime.prefetch.")
        assert type(state.prefetcher).name == prefetch
        for part in state.buffer.parts:
            assert type(part) is Partition
            assert type(part.queue) is TransferQueue
            assert type(part.policy).__module__.startswith("moe_runtime.buffer.")
            assert type(part.policy).name == cache
        if "eam" in (prefetch, cache):
            assert type(state.recorder).__module__ == "tracer.recorder"


@pytest.mark.parametrize(("prefetch", "cache"), [(p, c) for _, p, c in COMBOS if p != "oracle"])
def test_accounting_is_consistent(prefetch: str, cache: str) -> None:
    reqs = random_requests(1, 5, 3, 6, 2, 7)
    sim = sim_for()
    run = sim.run(prefetch, cache, reqs[:2], reqs[2:])
    st = run.stats
    assert st["lookups"] == run.lookups
    assert st["hits"] + st["misses"] == st["lookups"]
    assert st["hits"] + st["late_prefetches"] + st["demand_fetches"] == st["lookups"]
    assert st["hits_prefetched"] <= st["hits"]
    assert st["demand_bytes"] == st["demand_fetches"] * 1000
    assert st["prefetch_used"] <= st["prefetch_issued"]
    assert 0.0 <= run.hit_rate <= 1.0 and st["blocking_s"] >= 0.0
    assert run.tokens == sum(r.output_tokens for r in reqs[2:])


def _layer_sets(r: SimRequest) -> list[np.ndarray]:
    """Per step (batch 1) and layer, the ids of that step's tokens."""
    steps = [r.ids[: r.num_prefill]] if r.num_prefill else []
    steps += [r.ids[i : i + 1] for i in range(r.num_prefill, r.num_rows)]
    return [s[:, layer] for s in steps for layer in range(r.ids.shape[1])]


def test_lookups_match_the_trace_at_batch_one() -> None:
    reqs = random_requests(2, 3, 3, 6, 2, 6)
    sim = sim_for(batch=1)
    run = sim.run("on-demand", "lru", [], reqs)
    assert run.lookups == sum(len(np.unique(s)) for r in reqs for s in _layer_sets(r))


def test_deterministic() -> None:
    reqs = random_requests(3, 6, 3, 6, 2, 8)
    results = []
    for _ in range(2):
        runs = run_combos(sim_for(), list(COMBOS), reqs[:2], reqs[2:])
        results.append([(r.stats, r.tpot_s, r.sim_seconds) for r in runs])
    assert results[0] == results[1]


def test_everything_resident_never_blocks() -> None:
    reqs = random_requests(4, 3, 2, 4, 2, 5)
    run = sim_for(layers=2, experts=4, slots=8).run("eam", "eam", reqs[:1], reqs[1:])
    assert run.hit_rate == 1.0 and run.stats["blocking_s"] == 0.0
    assert run.stats["demand_bytes"] == run.stats["prefetch_bytes"] == 0


def test_on_demand_timing_by_hand() -> None:
    """One slot, every step needs the other expert: each step waits one full transfer."""
    rows = 5
    ids = np.array([[[i % 2]] for i in range(rows)], dtype=np.int64)  # [T, L=1, k=1]
    req = SimRequest("r", None, ids, np.ones(ids.shape, np.float32), 0)
    cost = CostModel.measured(
        transfer_s=1.0, expert_a_s=0.25, expert_b_s=0.0, layer_fixed_s=0.1, layer_b_s=0.0, step_fixed_s=0.0
    )
    sim = Simulator(1, 2, 1, 1000, cost, SimConfig(slots=1, batch=1))
    run = sim.run("on-demand", "lru", [], [req])
    assert run.stats["hits"] == 0 and run.stats["demand_fetches"] == rows
    assert run.stats["blocking_s"] == pytest.approx(rows * 1.0)
    assert run.tpot_s == pytest.approx(0.1 + 1.0 + 0.25)
    assert run.sim_seconds == pytest.approx(rows * 1.35)


def test_resident_experts_compute_while_the_miss_loads() -> None:
    """Two slots, layer needs a cached expert and a missing one: compute overlaps the copy."""
    ids = np.array([[[0, 1]], [[0, 2]]], dtype=np.int64)  # step 1 loads 0, 1; step 2 hits 0, misses 2
    req = SimRequest("r", None, ids, np.ones(ids.shape, np.float32), 0)
    cost = CostModel.measured(
        transfer_s=1.0, expert_a_s=0.4, expert_b_s=0.0, layer_fixed_s=0.0, layer_b_s=0.0, step_fixed_s=0.0
    )
    sim = Simulator(1, 3, 2, 1000, cost, SimConfig(slots=2, batch=1))
    state = sim.make_state("on-demand", "lru")
    t0 = state.buffer.now
    sim._run_batches(state, [req])
    st = state.buffer.stats
    assert st.total_hits == 1
    # step 1: wait 1.0 for expert 0, compute 0.4 while expert 1 loads, wait 0.6, compute 0.4;
    # step 2: the hit computes 0.4 while expert 2 loads for 1.0 -> wait 0.6, then compute 0.4
    assert st.total_blocking_s == pytest.approx(1.0 + 0.6 + 0.6)
    assert state.buffer.now - t0 == pytest.approx(2.4 + 1.4)


def test_layer_jitter_is_seeded_and_keeps_the_mean_layer_time() -> None:
    """Layer-time noise: off by default, the same draws for a seed, other draws for another seed,
    and the simulated time stays near the noiseless one (zero-mean noise; few clip at 0)."""
    reqs = random_requests(3, 6, 3, 6, 2, 6)
    cost = CostModel.measured(
        transfer_s=1.0, expert_a_s=0.2, expert_b_s=0.01, layer_fixed_s=2.0, layer_b_s=0.0, step_fixed_s=0.1
    )

    def run(jitter: float, seed: int = 0):
        cfg = SimConfig(slots=5, batch=2, layer_jitter_s=jitter, jitter_seed=seed)
        r = Simulator(3, 6, 2, 1000, cost, cfg).run("next-layer-all", "lru", reqs[:2], reqs[2:])
        return r.sim_seconds, r.stats

    base = run(0.0)
    assert run(0.0) == base
    a, b, c = run(0.3), run(0.3), run(0.3, seed=1)
    assert a == b and a != base and a != c
    assert abs(a[0] - base[0]) < 0.1 * base[0]


@pytest.mark.parametrize("devices", [1, 2])
def test_prefetch_ranked_queues_the_first_free_keys_up_to_capacity(devices: int) -> None:
    """``SimBuffer.prefetch_ranked`` (``partition.apply_ranked_plan``: a plan the policy ranked,
    one compiled call on one device, per device on several) leaves the queues, the counters and
    the I/O as handing ``prefetch`` the plan's keys not held, up to the prefetch capacity, does."""
    from moeserve.sim.buffer import SimBuffer

    L, E = 4, 8
    bufs = [SimBuffer(L, E, 6, devices, 1000, 1e-3) for _ in range(2)]
    rng = np.random.default_rng(devices)
    for step in range(12):
        layer = step % (L - 1)
        keys = (layer + 1) * E + rng.permutation(E)[: int(rng.integers(0, E + 1))].astype(np.int64)
        priorities = -np.sort(-rng.integers(1, 4, size=keys.size) / 4)  # best first, with ties
        ranked, ref = bufs
        with ranked.cond:
            ranked.prefetch_ranked(keys, priorities)
        with ref.cond:
            free = ~ref.held[keys]
            limit = ref.prefetch_capacity()
            ref.prefetch(keys[free][:limit], priorities[free][:limit], replace=True)
        for a, b in zip(ranked.parts, ref.parts, strict=True):
            assert a.queue.queued_prefetch_keys() == b.queue.queued_prefetch_keys()
        assert ranked.stats.prefetch_issued == ref.stats.prefetch_issued
        assert ranked.stats.prefetch_cancelled == ref.stats.prefetch_cancelled
        needed = sorted(rng.choice(E, size=2, replace=False).tolist())
        for buf in bufs:  # the layer runs: copies land, slots fill
            buf.run_layer(layer, needed, lambda e: 2e-3)
        np.testing.assert_array_equal(ranked.held, ref.held)


@pytest.mark.parametrize("devices", [1, 2])
def test_prefetch_best_queues_what_best_free_then_prefetch_queue(devices: int) -> None:
    """``SimBuffer.prefetch_best`` (``partition.apply_best_plan``: one fused call on one device,
    select then re-plan per device on several) leaves the queues, the counters and the I/O as
    selecting with ``best_free`` and handing the plan to ``prefetch`` does."""
    from moe_runtime.io.transfer_queue import best_free
    from moeserve.sim.buffer import SimBuffer

    L, E = 4, 8
    bufs = [SimBuffer(L, E, 6, devices, 1000, 1e-3) for _ in range(2)]
    rng = np.random.default_rng(devices)
    for step in range(12):
        layer = step % (L - 1)
        scores = (rng.integers(0, 4, size=(1, E)) / 4).astype(np.float32)
        limit = int(rng.integers(0, 6))
        base = (layer + 1) * E
        fused, ref = bufs
        with fused.cond:
            keys, best = fused.prefetch_best(scores.reshape(-1), base, limit)
        with ref.cond:
            want_keys, want_best = best_free(scores.reshape(-1), ref.held[base : base + E], limit)
            ref.prefetch(want_keys + base, want_best, replace=True)
        np.testing.assert_array_equal(keys, want_keys + base)
        np.testing.assert_array_equal(best, want_best)
        for a, b in zip(fused.parts, ref.parts, strict=True):
            assert a.queue.queued_prefetch_keys() == b.queue.queued_prefetch_keys()
        assert fused.stats.prefetch_issued == ref.stats.prefetch_issued
        assert fused.stats.prefetch_cancelled == ref.stats.prefetch_cancelled
        needed = sorted(rng.choice(E, size=2, replace=False).tolist())
        for buf in bufs:  # the layer runs: copies land, slots fill
            buf.run_layer(layer, needed, lambda e: 2e-3)
        np.testing.assert_array_equal(fused.held, ref.held)
