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
        buf.prefetch([key(1, 0), key(1, 1), key(1, 2)], [1.0, 0.9, 0.8])
        time.sleep(0.01)  # the first one is in flight now
        buf.prefetch([key(2, 5)], [1.0])  # replan: queued 1/1 and 1/2 fall out
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
        buf.prefetch([2 * E + 3], [1.0])
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
        buf.prefetch([E + e for e in range(5)], [1.0 - e / 10 for e in range(5)])  # 5 slow prefetches queued
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


class _LateClock:
    """A fake ``time`` for ``moe_runtime.io.link``: every sleep returns ``late`` seconds past
    its deadline, as ``time.sleep`` does on a real host (75-100 us on the development VM)."""

    def __init__(self, late: float) -> None:
        self.now, self.late = 1.0, late

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.late


def test_link_model_back_to_back_copies_do_not_pay_each_late_wake_up(monkeypatch):
    import moe_runtime.io.link as link_mod

    clock = _LateClock(late=100e-6)
    monkeypatch.setattr(link_mod, "time", clock)
    link = LinkModel(gbps=0.5, latency_us=10.0)
    per = link.transfer_seconds(98_304)  # one bundled-model expert: 207 us
    t0 = clock.now
    ready = t0
    for _ in range(10):  # a queue of copies: each ready before the I/O thread comes back
        link.hold(98_304, clock.perf_counter(), ready_at=ready)
    assert clock.now == pytest.approx(t0 + 10 * per + clock.late)  # one late return, not ten
    assert link.idle_s == pytest.approx(0.0, abs=1e-12)
    # without ready_at (the I/O thread waited for each transfer) every late return is paid
    slow = LinkModel(gbps=0.5, latency_us=10.0)
    t1 = clock.now
    for _ in range(10):
        slow.hold(98_304, clock.perf_counter())
    assert clock.now == pytest.approx(t1 + 10 * (per + clock.late))
    assert slow.idle_s == pytest.approx(9 * clock.late)


def test_link_model_starts_a_transfer_no_earlier_than_it_was_ready(monkeypatch):
    import moe_runtime.io.link as link_mod

    clock = _LateClock(late=0.0)
    monkeypatch.setattr(link_mod, "time", clock)
    link = LinkModel(gbps=1.0)
    link.hold(1000, clock.perf_counter())  # 1 us, ends at t = 1.000001
    clock.now += 0.5  # the I/O thread comes back much later
    back = clock.now
    link.hold(1000, back, ready_at=back - 0.1)  # queued 0.1 s ago: its link time is long over
    assert clock.now == back  # no sleep
    assert link.idle_s == pytest.approx(0.4)  # idle from the first end until it was queued
    link.hold(1000, clock.perf_counter(), ready_at=back + 5.0)  # a ready_at after started is ignored
    assert clock.now == pytest.approx(back + 1e-6)


def test_queued_copies_run_back_to_back_on_the_emulated_link():
    """A queue of prefetches moves at the link's nominal rate: the I/O thread goes from one
    landed copy straight to the next, which starts at the previous one's deadline."""
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], L * E - 1, link=(0.05, 0.0))
    try:
        keys = list(range(1, L * E))
        buf.prefetch(keys, [1.0] * len(keys))
        deadline = time.monotonic() + 10
        while buf.stats.prefetch_bytes < len(keys) * buf.store.expert_nbytes:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        link = buf.parts[0].link
        assert link.idle_s == pytest.approx(0.0, abs=1e-9)
    finally:
        buf.close()


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
            assert sum(part.pins) == 0
        consume(buf, 1, [0, 1, 2])  # the buffer still works
    finally:
        buf.close()


def _push_reference(q: TransferQueue, plan: list[tuple[int, float]], replace: bool) -> None:
    """The pre-bulk semantics of a plan: cancel what fell out, then one push per changed entry."""
    if replace:
        wanted = {k for k, _ in plan}
        for k in q.queued_prefetch_keys():
            if k not in wanted:
                q.cancel(k)
    for key, prio in plan:
        queued = q.queued(key)
        if queued is not None and (queued.demand or queued.priority == prio):
            continue
        q.push(Transfer(key, demand=False, priority=prio))


def _drain(q: TransferQueue) -> list[tuple[int, bool, float]]:
    out = []
    while (t := q.pop()) is not None:
        out.append((t.key, t.demand, t.priority))
    return out


@pytest.mark.parametrize("by_priority", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_queue_replan_pops_like_one_push_per_entry(seed: int, by_priority: bool) -> None:
    """``by_priority``: plans best first, as ``PrefetchPolicy.issue`` builds them (the queue then
    skips its sort when every entry is re-pushed)."""
    rng = np.random.default_rng(seed)
    bulk, ref = TransferQueue(), TransferQueue()
    for _ in range(12):
        if rng.random() < 0.3:  # a demand, sometimes for a queued prefetch's key
            key = int(rng.integers(0, 16))
            for q in (bulk, ref):
                q.push(Transfer(key, demand=True))
        keys = rng.choice(16, size=int(rng.integers(0, 10)), replace=False).tolist()
        plan = [(k, float(rng.choice([0.25, 0.5, 0.75]))) for k in keys]  # ties are common
        if by_priority:
            plan.sort(key=lambda e: -e[1])
        replace = bool(rng.random() < 0.8)
        bulk.replan(np.array([k for k, _ in plan], dtype=np.int64), np.array([p for _, p in plan]), replace)
        _push_reference(ref, plan, replace)
        assert sorted(bulk.queued_prefetch_keys()) == sorted(ref.queued_prefetch_keys())
        if rng.random() < 0.3:  # the I/O thread takes one
            a, b = bulk.pop(), ref.pop()
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.key, a.demand, a.priority) == (b.key, b.demand, b.priority)
    assert _drain(bulk) == _drain(ref)


@pytest.mark.parametrize("seed", range(12))
def test_queue_replan_ranked_is_the_first_free_keys_then_replan(seed: int) -> None:
    """A plan the policy ranked itself (``kernels.limit_gate_plan``) queued in one compiled call
    leaves the queue as ``replan`` with its first ``limit`` keys not held does, and counts the
    same prefetches."""
    rng = np.random.default_rng(seed)
    ranked, ref = TransferQueue(num_keys=48), TransferQueue(num_keys=48)
    for step in range(10):
        if rng.random() < 0.3:  # a demand, sometimes for a queued prefetch's key
            key = int(rng.integers(0, 48))
            for q in (ranked, ref):
                q.push(Transfer(key, demand=True))
        keys = rng.permutation(48)[: int(rng.integers(0, 20))].astype(np.int64)
        priorities = -np.sort(-rng.integers(1, 4, size=keys.size) / 4)  # falling, with ties
        held = rng.random(48) < 0.3
        limit = int(rng.integers(0, 8))
        free = keys[~held[keys]][:limit]
        got = ranked.replan_ranked(keys, priorities, held, limit, True, now=float(step))
        assert got == ref.replan(free, priorities[~held[keys]][:limit], True, now=float(step))
        assert ranked.queued_prefetch_keys() == ref.queued_prefetch_keys()
        if rng.random() < 0.3:  # the I/O thread takes one
            a, b = ranked.pop(), ref.pop()
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.key, a.demand, a.priority) == (b.key, b.demand, b.priority)
                assert a.demand or a.queued_at == b.queued_at  # a prefetch's queue time is the plan's
    assert _drain(ranked) == _drain(ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(12))
def test_queue_replan_best_is_best_free_then_replan(seed: int, dtype: type) -> None:
    """The fused selection and re-plan (one compiled call per planning layer) leaves the queue as
    ``best_free`` then ``replan`` do, returns the same plan, and counts the same prefetches."""
    from moe_runtime.io.transfer_queue import best_free

    rng = np.random.default_rng(seed)
    fused, ref = TransferQueue(num_keys=48), TransferQueue(num_keys=48)
    for step in range(10):
        if rng.random() < 0.3:  # a demand, sometimes for a queued prefetch's key
            key = int(rng.integers(0, 48))
            for q in (fused, ref):
                q.push(Transfer(key, demand=True))
        base = int(rng.integers(0, 3)) * 16
        flat = (rng.integers(0, 4, size=16) / 4).astype(dtype)  # ties and zeros
        held = rng.random(16) < 0.3
        limit = int(rng.integers(0, 8))
        keys, scores, issued, cancelled = fused.replan_best(flat, held, limit, base, True, now=float(step))
        want_keys, want_scores = best_free(flat, held, limit)
        want_keys = want_keys + base
        np.testing.assert_array_equal(keys, want_keys)
        np.testing.assert_array_equal(scores, want_scores)
        assert (issued, cancelled) == ref.replan(want_keys, want_scores, True, now=float(step))
        assert fused.queued_prefetch_keys() == ref.queued_prefetch_keys()
        if rng.random() < 0.3:  # the I/O thread takes one
            a, b = fused.pop(), ref.pop()
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.key, a.demand, a.priority) == (b.key, b.demand, b.priority)
                assert a.demand or a.queued_at == b.queued_at  # a prefetch's queue time is the plan's
    assert _drain(fused) == _drain(ref)


def test_queue_grows_past_its_key_space_and_keeps_order() -> None:
    q = TransferQueue(num_keys=4)
    q.replan(np.array([3, 40]), np.array([0.5, 0.9]), replace=True)
    q.push(Transfer(100, demand=False, priority=0.7))
    q.push(Transfer(200, demand=True))
    assert q.queued(100).priority == 0.7 and q.queued(200).demand
    assert [t.key for t in iter(q.pop, None)] == [200, 40, 100, 3]
    assert len(q) == 0


@pytest.mark.parametrize("policy_name", ["lru", "eam", "model-counts", "oracle"])
@pytest.mark.parametrize("seed", range(6))
def test_partition_evictable_bookkeeping_matches_a_full_scan(policy_name: str, seed: int) -> None:
    """Random slot traffic: the incrementally kept evictable slots, prefetch capacity and victims
    equal a from-scratch scan of the slot states with the policy's own ``victim``."""
    from moe_runtime.buffer.cache_policy import make_cache_policy
    from moe_runtime.buffer.partition import READY, Partition
    from moe_runtime.prefetch.oracle import OracleSchedule
    from moe_runtime.stats import ExpertStats

    class Recorder:
        epoch = 0  # every answer is new counts: a new epoch each time

        def query(self, request_ids, layer):
            self.epoch += 1
            return rng.integers(0, 4, size=(1, L, E)).astype(np.float64)

    rng = np.random.default_rng(seed)
    slots = 5
    log = [(i % L, tuple(sorted(rng.choice(E, 2, replace=False).tolist()))) for i in range(400)]
    oracle = OracleSchedule(log, E)
    policy = make_cache_policy(policy_name, slots, E, num_layers=L, recorder=Recorder(), oracle=oracle)
    part = Partition(0, slots, E, 1, policy, ExpertStats(L))
    loading: dict[int, Transfer] = {}
    victims = 0

    def reference_victim(cands: list[int]) -> int:  # the pre-incremental full evaluation
        if policy_name == "oracle":
            cur = oracle.cursor
            nxt = [
                oracle.next_use(k, current=policy._used_at.get(k) != cur)
                for k in map(part.slot_key.__getitem__, cands)
            ]
            return cands[int(np.argmax(nxt))]
        if policy_name == "model-counts":
            vals = [policy.counts[part.slot_key[c]] + 1e-9 * policy.priority[c] for c in cands]
            return cands[int(np.argmin(vals))]
        return cands[int(np.argmin([policy.priority[c] for c in cands]))]

    for _ in range(300):
        op = rng.integers(0, 6)
        ev_d = [s for s in range(slots) if part.state[s] == READY and part.pins[s] == 0]
        ev_p = [s for s in ev_d if not part.prefetched[s]]
        assert part.evictable(True).tolist() == ev_d and part.evictable(False).tolist() == ev_p
        assert part.capacity_for_prefetch() == len(part.free) + len(ev_p)
        if op == 0:  # the oracle's cursor moves / routing updates counts
            if oracle.cursor + 1 < len(log):
                layer = log[oracle.cursor + 1][0]
                oracle.advance(layer)
                policy.after_routing(layer, ["r"], rng.integers(0, E, size=(2, 2)))
        elif op in (1, 2):  # allocate a demand or a prefetch
            key = int(rng.integers(0, L * E))
            if key in part.key_slot:
                continue
            t = Transfer(key, demand=op == 1)
            cands = ev_d if t.demand else ev_p
            had_free = bool(part.free)
            want = None if had_free or not cands else reference_victim(cands)
            s = part.allocate(t)
            if not had_free:
                assert s == want
                victims += want is not None
            if s is not None:
                loading[s] = t
        elif op == 3 and loading:  # a copy lands; a demanded expert is used right away
            s = list(loading)[int(rng.integers(0, len(loading)))]
            t = loading.pop(s)
            part.land(s, t)
            if t.demand:
                part.release(s)
        elif op == 4:  # the running layer pins a resident expert, uses it, releases it
            ready = [s for s in range(slots) if part.state[s] == READY]
            if ready:
                s = ready[int(rng.integers(0, len(ready)))]
                part.pin(s)
                if rng.random() < 0.5:
                    part.release(s)
                else:
                    part.unpin(s)
        else:  # a layer runs: its unneeded prefetches are settled
            layer = int(rng.integers(0, L))
            part.settle_prefetches(layer, {layer * E + int(rng.integers(0, E))})
    assert victims > 10


def test_link_thread_timer_slack_is_set_on_linux():
    import sys

    out = {}

    def probe() -> None:
        out["set"] = LinkModel.bind_thread()
        if sys.platform.startswith("linux"):
            import ctypes

            out["slack"] = ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK

    th = threading.Thread(target=probe)
    th.start()
    th.join()
    if sys.platform.startswith("linux"):
        assert out == {"set": True, "slack": 1000}
    else:
        assert out == {"set": False}


def test_a_layers_demand_fetches_land_in_one_round_without_a_link():
    """Without link emulation the I/O thread takes the demand fetches a layer queued in one round
    (up to MAX_COPY_BATCH) and lands them together: the layer runs its misses as one batch instead
    of one lock round-trip and wake-up per expert."""
    from moe_runtime.buffer.expert_buffer import MAX_COPY_BATCH

    buf = ExpertBuffer(make_store(), [torch.device("cpu")], L * E - 1)
    try:
        run = buf.start_layer(0, [0, 1, 2, 3, 4])  # nothing resident: five demand fetches
        batches = [[h.expert for h in b] for b in run.batches()]
        assert batches == [[0, 1, 2, 3, 4]]
        assert MAX_COPY_BATCH >= 5
        run = buf.start_layer(1, list(range(E)))  # six more than one round: two rounds at most
        assert 1 <= len(list(run.batches())) <= 2
        assert buf.stats.demand_bytes == (5 + E) * buf.store.expert_nbytes
    finally:
        buf.close()


def test_expert_batches_count_the_resident_batch_and_each_landed_group() -> None:
    """``ExpertStats.expert_batches``: per layer run, one batch for the resident experts and one
    per group of experts that landed together; an all-resident buffer runs one batch per layer."""
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 4)
    try:
        consume(buf, 0, [0, 1])  # two misses: they land in one or two batches
        first = buf.stats.expert_batches[0]
        assert 1 <= first <= 2
        run = buf.start_layer(0, [0, 1, 2])  # 0 and 1 resident now, 2 missing
        batches = [[h.expert for h in b] for b in run.batches()]
        assert batches == [[0, 1], [2]]
        assert buf.stats.expert_batches[0] == first + 2
        assert buf.stats.expert_batches[1:] == [0, 0]
    finally:
        buf.close()
    resident = ExpertBuffer(make_store(), [torch.device("cpu")], L * E)
    try:
        consume(resident, 2, [0, 3, 5])
        consume(resident, 2, [])
        assert resident.stats.expert_batches == [0, 0, 1]
    finally:
        resident.close()


def test_the_io_threads_own_work_per_copy_is_measured_apart_from_the_copies() -> None:
    """``copy_host_seconds`` (the prefetch gate's ``h``): the I/O thread's CPU time per copy
    outside the copy and the link's wait; on an emulated link far slower than the copies its
    sleeps are left out, so the figure stays far below a copy's link time."""
    for link in (None, (1e-4, 0.0)):  # memcpy; a link of about 4 ms per copy of this store
        buf = ExpertBuffer(make_store(), [torch.device("cpu")], 4, link=link)
        try:
            assert buf.copy_host_seconds is None  # nothing copied yet
            consume(buf, 0, [0, 1, 2])
            h = buf.copy_host_seconds
            assert h is not None and 0 < h < 0.02, h
            if link is not None:
                assert h < buf.copy_seconds / 4, (h, buf.copy_seconds)
        finally:
            buf.close()


def test_copies_are_timed_by_the_io_thread() -> None:
    """Every landed copy is counted with its seconds as the I/O thread timed it: the memcpy
    without a link; with an emulated link its own time per copy, exactly (the gate's link time)."""
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 4)
    try:
        assert buf.copy_seconds is None  # nothing copied yet
        consume(buf, 0, [0, 1, 2])
        st = buf.stats
        assert st.copies == 3 == sum(st.demand_fetches)
        assert 0 < st.copy_s < 1.0 and 0 < buf.copy_seconds < 1.0
    finally:
        buf.close()
    buf = ExpertBuffer(make_store(), [torch.device("cpu")], 4, link=(1.0, 20.0))
    try:
        consume(buf, 1, [0, 1])
        consume(buf, 2, [3])
        per = buf.parts[0].link.transfer_seconds(buf.store.expert_nbytes)
        assert buf.copy_seconds == per and buf.stats.copies == 3
        assert buf.stats.copy_s == pytest.approx(3 * per)
    finally:
        buf.close()
