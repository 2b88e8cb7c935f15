"""The hybrid cost model (``moe_runtime.hybrid.cost_model``): pure arithmetic the runtime's placement
and a simulator share. The greedy intra-layer split (HybriMoE) puts each miss where it finishes
first, ties to the device; a prefill chunk's many-token experts go to the device by the same rule;
``cpu`` mode puts every miss on the CPU; the placement is a function of its inputs (deterministic);
the CPU and link sides end close together; the online fit follows its samples; the prefetch
gate's blocking per miss is capped by the CPU's time."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from moe_runtime.hybrid.cost_model import (
    LayerCosts,
    LinearCost,
    blocking_per_miss,
    device_lanes,
    place_layer,
)
from moe_runtime.prefetch.gate import PrefetchGate

MS = 1e-3


def costs(miss_rows, *, link_ms=6.0, backlog_ms=0.0, resident=(), inflight=(), lanes=1) -> LayerCosts:
    return LayerCosts(
        [list(resident)], [list(inflight)], list(miss_rows), [0] * len(miss_rows), [link_ms * MS],
        [backlog_ms * MS], lanes,
    )  # fmt: skip


# decode-like: the CPU reads an expert in 2 ms, +0.5 ms per row; the device 0.1 ms, +0.01 per row
CPU = LinearCost(2 * MS, 0.5 * MS)
DEV = LinearCost(0.1 * MS, 0.01 * MS)


def test_module_has_no_threads_clocks_or_torch():
    """The simulator imports it: no threading, clocks or torch devices."""
    src = Path(__file__).resolve().parents[1] / "moe_runtime" / "hybrid" / "cost_model.py"
    names = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= {"__future__", "collections", "dataclasses"}, names


def test_greedy_split_balances_cpu_and_link():
    """Five one-row misses, one CPU lane (2.5 ms each) against a 6 ms link: the CPU takes the
    first two (finishing at 2.5 and 5.0 ms), the link the third (6.11 ms), the CPU the fourth
    (7.5 < 12.1), and so on: both sides end within one expert of each other."""
    p = place_layer(costs([1] * 5), CPU, DEV)
    assert p.on_cpu == (True, True, False, True, True)
    assert p.cpu_s == pytest.approx(10 * MS) and p.device_s == pytest.approx(6.11 * MS)
    assert p.predicted_s == max(p.cpu_s, p.device_s)
    assert abs(p.cpu_s - p.device_s) < CPU.predict(1) + 6 * MS


def test_a_prefill_chunk_goes_to_the_device_by_the_same_rule():
    """256 rows of one expert cost the CPU 130 ms, the link and device 8.6 ms: the device."""
    p = place_layer(costs([256, 1]), CPU, DEV)
    assert p.on_cpu == (False, True)


def test_ties_go_to_the_device():
    cpu = LinearCost(6.11 * MS, 0.0)  # exactly the link's 6 ms plus the device's 0.11
    assert place_layer(costs([1]), cpu, DEV).on_cpu == (False,)
    assert place_layer(costs([1]), LinearCost(6.1 * MS, 0.0), DEV).on_cpu == (True,)


def test_backlog_and_resident_work_push_misses_to_the_cpu():
    fast_link = costs([1], link_ms=1.0)
    assert place_layer(fast_link, CPU, DEV).on_cpu == (False,)
    assert place_layer(costs([1], link_ms=1.0, backlog_ms=5.0), CPU, DEV).on_cpu == (True,)
    busy = costs([1], link_ms=1.0, resident=[1] * 40)  # 4.4 ms of resident work on the device
    assert place_layer(busy, CPU, DEV).on_cpu == (True,)


def test_the_cpu_lanes_start_delay_counts_only_where_an_expert_runs_there():
    """One miss, a 1 ms link: the CPU's 2.5 ms loses already; with a 1 ms link backlog of 5 ms the
    CPU wins (2.5 < 6.11), but not once its lanes start 4 ms late (the pool's wake-up and the
    interpreter lock): 6.5 > 6.11. With nothing placed there the delay is not in the layer's time."""

    def late(start_ms: float) -> LayerCosts:
        c = costs([1], link_ms=1.0, backlog_ms=5.0)
        return LayerCosts(c.resident_rows, c.inflight_rows, c.miss_rows, c.miss_part, c.link_s,
                          c.link_backlog_s, c.cpu_lanes, cpu_start_s=start_ms * MS)  # fmt: skip

    assert place_layer(late(0.0), CPU, DEV).on_cpu == (True,)
    assert place_layer(late(3.0), CPU, DEV).on_cpu == (True,)  # 5.5 < 6.11
    p = place_layer(late(4.0), CPU, DEV)
    assert p.on_cpu == (False,) and p.cpu_s == 0.0 and p.predicted_s == pytest.approx(6.11 * MS)
    assert place_layer(late(4.0), CPU, DEV, "cpu").cpu_s == pytest.approx(6.5 * MS)


def test_cpu_mode_places_every_miss_on_the_cpu_and_device_mode_none():
    assert place_layer(costs([256, 1, 1]), CPU, DEV, "cpu").on_cpu == (True, True, True)
    assert place_layer(costs([1, 1]), CPU, DEV, "device").on_cpu == (False, False)
    with pytest.raises(ValueError):
        place_layer(costs([1], lanes=0), CPU, DEV, "cpu")
    with pytest.raises(ValueError):
        place_layer(costs([1]), CPU, DEV, "fastest")


def test_more_lanes_take_more_misses():
    one = sum(place_layer(costs([1] * 8, lanes=1), CPU, DEV).on_cpu)
    four = sum(place_layer(costs([1] * 8, lanes=4), CPU, DEV).on_cpu)
    assert four > one


def test_placement_is_deterministic_given_its_inputs():
    """The same inputs give the same placement, whatever the order misses came in (each miss's
    placement follows it), over random inputs."""
    rng = random.Random(0)
    for _ in range(200):
        rows = [rng.choice([1, 1, 2, 3, 8, 64]) for _ in range(rng.randint(0, 12))]
        c = costs(rows, link_ms=rng.uniform(0.5, 10), backlog_ms=rng.uniform(0, 10), lanes=rng.randint(1, 4))
        a, b = place_layer(c, CPU, DEV), place_layer(c, CPU, DEV)
        assert a == b
        perm = list(range(len(rows)))
        rng.shuffle(perm)
        # rows descending, then miss order: a permutation of equal rows may swap which of them goes
        # where, never how many of each row count go to the CPU
        shuffled = place_layer(
            LayerCosts(c.resident_rows, c.inflight_rows, [rows[i] for i in perm], [0] * len(rows),
                       c.link_s, c.link_backlog_s, c.cpu_lanes),
            CPU, DEV,
        )  # fmt: skip
        assert shuffled.predicted_s == pytest.approx(a.predicted_s)
        for r in set(rows):
            assert sum(o for o, x in zip(a.on_cpu, rows) if x == r) == sum(
                o for o, i in zip(shuffled.on_cpu, perm) if rows[i] == r
            )


def test_the_device_lanes_are_place_layers_own_when_nothing_is_missed():
    """``device_lanes`` (the placer's prediction for a layer with no miss) is ``place_layer``'s."""
    c = costs([], resident=[1, 3], inflight=[2], backlog_ms=4.0)
    assert place_layer(c, CPU, DEV).predicted_s == pytest.approx(
        max(device_lanes([[1, 3]], [[2]], [4 * MS], DEV))
    )


def test_multi_partition_links_are_separate():
    c = LayerCosts([[], []], [[], []], [1, 1], [0, 1], [6 * MS, 6 * MS], [0.0, 0.0], 0)
    p = place_layer(c, CPU, DEV)  # no CPU lane: both copied, each on its own link
    assert p.on_cpu == (False, False) and p.device_s == pytest.approx(6.11 * MS)


def test_linear_fit_follows_samples_and_keeps_the_prior_slope():
    fit = LinearCost(1 * MS, 0.1 * MS)
    for _ in range(200):  # decode samples only: one row, 3 ms
        fit.observe(1, 1, 3 * MS)
    assert fit.predict(1) == pytest.approx(3 * MS, rel=0.05)
    assert fit.per_row_s > 0  # the prior's slope is not lost to one-row samples
    fit2 = LinearCost(1 * MS, 0.1 * MS)
    for rows in (1, 8, 32, 1, 8, 32) * 30:  # a line: 0.5 ms + 0.2 ms per row
        fit2.observe(1, rows, 0.5 * MS + 0.2 * MS * rows)
    assert fit2.per_expert_s == pytest.approx(0.5 * MS, rel=0.25)  # the prior pulls a little
    assert fit2.per_row_s == pytest.approx(0.2 * MS, rel=0.1)
    fit2.observe(2, 4, 1.0)  # a batch of two experts counts both
    assert fit2.samples == 181


def test_blocking_per_miss_is_the_cheaper_side():
    assert blocking_per_miss(5 * MS, None) == 5 * MS
    assert blocking_per_miss(5 * MS, 2 * MS) == 2 * MS
    assert blocking_per_miss(1 * MS, 2 * MS) == 1 * MS


def test_prefetch_gate_caps_b_by_the_cpu_time():
    """With hybrid execution the gate's ``b`` is min(link wait, CPU time); without, unchanged."""
    gate = PrefetchGate(4, 8, 1)
    gate.block_per_miss_s = 6 * MS
    assert gate.miss_cost_s(6 * MS) == 6 * MS and gate.idle_save(6 * MS) == 6 * MS
    gate.cpu_miss_s = 2 * MS
    assert gate.miss_cost_s(6 * MS) == 2 * MS
    gate.block_per_layer_s = 10 * MS
    assert gate.idle_save(6 * MS) == 2 * MS
    gate.block_per_miss_s = 1 * MS
    assert gate.miss_cost_s(6 * MS) == 1 * MS
