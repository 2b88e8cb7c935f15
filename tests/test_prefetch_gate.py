"""Cost-aware prefetching (``moe_runtime.prefetch.gate``): the terms follow what is observed, and
with nothing worth prefetching the ``eam`` policy is on-demand."""

from __future__ import annotations

import numpy as np
import pytest

from moe_runtime.prefetch.eam import _ranked
from moe_runtime.prefetch.gate import PrefetchGate
from moe_runtime.stats import ExpertStats
from tests.test_sim_engine import random_requests, sim_for


def test_precision_follows_the_routing_by_distance_and_rank() -> None:
    gate = PrefetchGate(num_layers=4, num_experts=4, depth=2, decay=1.0, prior=(1.0, 2.0))
    gate.observe(0, np.array([[0, 1]]))
    rows = np.array([[0.6, 0.3, 0.1, 0.0], [0.0, 0.0, 0.5, 0.5]])  # layers 1 and 2, from layer 0
    r, c, rank = _ranked(rows)
    np.testing.assert_array_equal(rank, [0, 1, 2, 0, 1])
    gate.note(1, 1, r, c, rank)
    gate.observe(1, np.array([[0, 2]]))  # used: rank 0 (expert 0) and rank 2 (expert 2); not rank 1
    prec = gate.precision()
    assert prec[0, 0] == pytest.approx(2 / 3) and prec[0, 2] == pytest.approx(2 / 3)
    assert prec[0, 1] == pytest.approx(1 / 3)
    assert prec[1, 0] == pytest.approx(0.5)  # distance 2 not checked yet
    gate.observe(2, np.array([[3, 1]]))  # layer 2 used expert 3 (its rank 1), not expert 2 (rank 0)
    prec = gate.precision()
    assert prec[1, 0] == pytest.approx(1 / 3) and prec[1, 1] == pytest.approx(2 / 3)
    assert gate.checked == 5
    gate.note(1, 3, np.array([0]), np.array([1]), np.array([0]))
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
    np.testing.assert_array_equal(gate.pays(p, 1.0, reuse), [True, False, False, False])
    gate.demand_busy = 0.0  # an idle link: only the eviction counts
    np.testing.assert_array_equal(gate.pays(p, 1.0, reuse), [True, True, False, False])
    gate.demand_busy = 1.0  # demand keeps the link busy: a prefetch only moves a copy ahead
    assert not gate.pays(np.ones(4), 1.0, np.zeros(4)).any()
    gate.demand_busy, gate.block_per_miss_s = 0.5, 0.0  # fetches never block: nothing to gain
    assert not gate.pays(np.ones(4), 1.0, np.zeros(4)).any()


def test_eam_with_zero_precision_is_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = sim_for(layers=3, experts=6, slots=6, batch=2)
    reqs = random_requests(3, 8, 3, 6, 2, 8)
    monkeypatch.setattr(PrefetchGate, "precision", lambda self: np.zeros_like(self.hits))
    gated = sim.run("eam", "lru", reqs[:4], reqs[4:])
    base = sim.run("on-demand", "lru", reqs[:4], reqs[4:])
    assert gated.stats["prefetch_issued"] == 0
    assert gated.tpot_s == base.tpot_s and gated.stats["hits"] == base.stats["hits"]
    monkeypatch.setattr(PrefetchGate, "precision", lambda self: np.ones_like(self.hits))
    assert sim.run("eam", "lru", reqs[:4], reqs[4:]).stats["prefetch_issued"] > 0  # the same run, gate open
