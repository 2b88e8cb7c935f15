"""Expert buffer, transfer queue and link model semantics (no model needed)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.buffer.placement import home_devices
from moe_runtime.io.link import LinkModel
from moe_runtime.io.transfer_queue import Transfer, TransferQueue
from moe_runtime.store import HostExpertStore

L, E, H, INTER = 3, 6, 8, 4


def make_store() -> HostExpertStore:
    store = HostExpertStore(L, E, H, INTER, torch.float32)
    for layer in range(L):
        for e in range(E):
            for part in ("gate", "up", "down"):
                shape = (H, INTER) if part == "down" else (INTER, H)
                store.write(layer, e, part, torch.full(shape, float(layer * 100 + e)), "test")
    return store


def consume(buf: ExpertBuffer, layer: int, experts: list[int]) -> list[tuple[int, bool]]:
    seen = []
    for h in buf.run_layer(layer, experts):
        assert torch.all(h.gate_up == layer * 100 + h.expert)  # the right weights are in the slot
        assert torch.all(h.down == layer * 100 + h.expert)
        seen.append((h.expert, h.hit))
    return seen


def test_queue_demand_beats_prefetch_and_priority_orders_prefetches():
    q = TransferQueue()
    q.push(Transfer(1, demand=False, priority=0.5))
    q.push(Transfer(2, demand=False, priority=0.9))
    q.push(Transfer(3, demand=True))
    q.push(Transfer(4, demand=False, priority=0.1))
    assert [q.pop().key for _ in range(4)] == [3, 2, 1, 4]
    assert q.pop() is None


def test_queue_cancel_and_replace():
    q = TransferQueue()
    q.push(Transfer(1, demand=False, priority=0.5))
    q.push(Transfer(2, demand=False, priority=0.4))
    assert q.cancel(1) is not None and q.cancel(1) is None
    q.push(Transfer(2, demand=True))  # upgrade replaces the queued prefetch
    assert len(q) == 1
    t = q.pop()
    assert t.key == 2 and t.demand and q.pop() is None


def test_all_resident_buffer_hits_everything():
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], L * E)
    try:
        assert buf.all_resident
        assert consume(buf, 1, [0, 3, 5]) == [(0, True), (3, True), (5, True)]
        assert buf.stats.hit_rate == 1.0 and buf.stats.demand_bytes == 0
    finally:
        buf.close()


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_layer_needing_more_experts_than_slots_makes_progress(slots):
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], slots)
    try:
        seen = consume(buf, 0, list(range(E)))
        assert sorted(e for e, _ in seen) == list(range(E))
        assert buf.stats.demand_fetches[0] == E
        assert buf.stats.demand_bytes == E * buf.store.expert_nbytes
    finally:
        buf.close()


def test_resident_experts_run_first_and_lru_evicts_least_recent():
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 3)
    try:
        consume(buf, 0, [0, 1, 2])  # fills the 3 slots
        consume(buf, 0, [0])  # 0 is now most recent; 1 is least recent
        seen = consume(buf, 0, [4, 2])  # 2 resident -> first; 4 evicts 1 (LRU)
        assert seen == [(2, True), (4, False)]
        assert buf.resident(0, 0) and buf.resident(0, 2) and buf.resident(0, 4) and not buf.resident(0, 1)
    finally:
        buf.close()


def test_cancelled_prefetch_never_lands():
    store = make_store()
    buf = ExpertBuffer(store, [torch.device("cpu")], 4, link=(1e-5, 0.0))  # 10 kB/s: ~40 ms a transfer
    try:
        key = lambda layer, e: layer * E + e  # noqa: E731
        buf.prefetch([(key(1, 0), 1.0), (key(1, 1), 0.9), (key(1, 2), 0.8)])
        time.sleep(0.01)  # the first one is in flight now
        buf.prefetch([(key(2, 5), 1.0)])  # replan: queued 1/1 and 1/2 fall out
        deadline = time.time() + 5
        while time.time() < deadline and not buf.resident(2, 5):
            time.sleep(0.01)
        assert buf.resident(2, 5)
        assert not buf.resident(1, 1) and not buf.resident(1, 2)
        assert buf.stats.prefetch_cancelled == 2
        assert buf.stats.prefetch_issued == 4
    finally:
        buf.close()


def test_prefetched_expert_counts_as_hit_and_used():
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 2)
    try:
        buf.prefetch([(2 * E + 3, 1.0)])
        deadline = time.time() + 5
        while time.time() < deadline and not buf.resident(2, 3):
            time.sleep(0.005)
        assert consume(buf, 2, [3]) == [(3, True)]
        assert buf.stats.hits_prefetched[2] == 1 and buf.stats.prefetch_used == 1
        assert buf.stats.prefetch_bytes == buf.store.expert_nbytes
    finally:
        buf.close()


def test_demand_jumps_queued_prefetches():
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 6, link=(2e-5, 0.0))
    try:
        buf.prefetch([(E + e, 1.0 - e / 10) for e in range(5)])  # 5 slow prefetches queued
        t0 = time.perf_counter()
        consume(buf, 0, [2])
        waited = time.perf_counter() - t0
        per = buf.store.expert_nbytes / 2e4
        assert waited < 3.5 * per  # at most the in-flight prefetch plus its own transfer
    finally:
        buf.close()


def test_link_model_holds_for_bytes_over_bandwidth():
    link = LinkModel(gbps=0.01, latency_us=1000)  # 10 MB/s + 1 ms
    t0 = time.perf_counter()
    for _ in range(3):
        link.hold(100_000, time.perf_counter())
    elapsed = time.perf_counter() - t0
    assert 3 * 0.011 <= elapsed < 3 * 0.011 + 0.05


def test_blocking_time_is_measured_with_emulated_link():
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 2, link=(1e-5, 0.0))
    try:
        consume(buf, 0, [1])
        expected = buf.store.expert_nbytes / 1e4
        assert buf.stats.blocking_s[0] >= 0.8 * expected
    finally:
        buf.close()


def test_several_devices_each_with_own_buffer_and_thread():
    devices = [torch.device("cpu")] * 3
    buf = ExpertBuffer(make_store(), devices, 2)
    try:
        home = home_devices(L, E, 3)
        assert set(home.tolist()) == {0, 1, 2}
        names = {t.name for t in threading.enumerate()}
        assert {"moeserve-io-0", "moeserve-io-1", "moeserve-io-2"} <= names
        seen = consume(buf, 1, list(range(E)))
        assert sorted(e for e, _ in seen) == list(range(E))
        per_device = np.bincount(home[E : 2 * E], minlength=3)
        assert buf.stats.device_lookups == per_device.tolist()
    finally:
        buf.close()


def test_closing_layer_early_releases_pins_and_cancels_demand():
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 2)
    try:
        gen = buf.run_layer(0, [0, 1, 2, 3])
        next(gen)
        gen.close()
        for part in buf.parts:
            assert part.pins.sum() == 0
        consume(buf, 1, [0, 1, 2])  # the buffer still works
    finally:
        buf.close()
