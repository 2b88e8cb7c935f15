"""``SimBuffer``: the runtime's slot state machine driven by an event clock instead of threads.

NOTE: the runtime, re-timed. :class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer` has a compute
thread and one I/O thread per device sharing a lock; here both are one clock. ``now`` is the compute
thread's time. Each device's I/O "thread" holds at most one transfer, finishing at ``done_at``.
Before the compute side reads or changes anything at ``now`` (every public method, and every
``with buffer.cond:`` a policy takes), all I/O events up to ``now`` are replayed in order: a
transfer lands (:meth:`Partition.land`), then the I/O thread peeks its queue at that instant
exactly as ``ExpertBuffer._io_loop`` does (allocate a free or evictable slot, else a demand waits
for a release and a prefetch is dropped). Compute-side changes (new transfers, releases) wake an
idle I/O thread at ``now``. Because compute-side actions happen in time order and I/O is replayed
up to each one first, every decision sees the state the threaded runtime would see, minus thread
scheduling jitter (a fixed ``wake_s`` models the hand-back to a waiting compute thread). The
state machine, queues and cache policies are the runtime's own objects (:class:`Partition`,
:class:`TransferQueue`, :func:`make_cache_policy`); only the clock is new.

Semantics mirrored from ``ExpertBuffer.run_layer``: a hit is an expert READY when its layer runs;
a needed expert whose prefetch is in flight is a late prefetch (a miss that waits); a missing one
is queued as demand, which jumps every prefetch; resident experts compute first, then each waiting
one in landing order; the time compute waits is the blocking time (MoE-Infinity §5.1-5.2).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import numpy as np

from moe_runtime.buffer.cache_policy import make_cache_policy
from moe_runtime.buffer.partition import Partition
from moe_runtime.buffer.placement import home_devices
from moe_runtime.buffer.plans import (
    apply_best_plan,
    apply_prefetch_plan,
    apply_ranked_plan,
    look_up_layer,
    prefetch_capacity,
)
from moe_runtime.io.transfer_queue import Transfer
from moe_runtime.stats import ExpertStats

INF = float("inf")


class _Cond:
    """Stands in for the runtime's ``threading.Condition``: entering it replays I/O up to ``now``."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: SimBuffer) -> None:
        self._buffer = buffer

    def __enter__(self) -> _Cond:
        self._buffer.advance()
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _IO:
    """One device's I/O thread: the transfer in flight (slot, Transfer, finish time) or idle."""

    __slots__ = ("slot", "transfer", "done_at")

    def __init__(self) -> None:
        self.slot = -1
        self.transfer: Transfer | None = None
        self.done_at = INF


class SimBuffer:
    """Expert buffer over simulated time, with the interface the prefetch policies use.

    Args:
        num_layers, num_experts: ``L`` and ``E``.
        slots_per_device: slots of each device partition (>= 1), as ``ExpertBuffer`` takes them.
        num_devices: partitions; an expert's home is ``home_devices`` (MoE-Infinity §5.3).
        expert_nbytes: bytes per expert (byte counters).
        transfer_s: seconds per expert copy on each device's link.
        wake_s: seconds from a copy landing to the waiting compute thread resuming.
        cache_policy: registry name (``lru``, ``eam``, ``model-counts``, ``oracle``).
        policy_context: extra policy constructor arguments (``recorder``, ``oracle``).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots_per_device: int,
        num_devices: int,
        expert_nbytes: int,
        transfer_s: float,
        cache_policy: str = "lru",
        policy_context: dict[str, Any] | None = None,
        wake_s: float = 0.0,
    ) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.home = home_devices(num_layers, num_experts, num_devices)
        self._home = self.home.tolist()
        self.stats = ExpertStats(num_layers, num_devices)
        self.transfer_s = transfer_s
        self.wake_s = wake_s
        self.now = 0.0
        self.cond = _Cond(self)
        ctx = {"num_layers": num_layers, **(policy_context or {})}
        self.oracle = ctx.get("oracle")
        self.access_log: list[tuple[int, tuple[int, ...]]] | None = None
        self.parts: list[Partition] = []
        self.held = np.zeros(num_layers * num_experts, dtype=bool)  # resident or loading anywhere
        for i in range(num_devices):
            homed = np.flatnonzero(self.home == i)
            n = max(1, min(slots_per_device, len(homed)))
            policy = make_cache_policy(cache_policy, n, num_experts, **ctx)
            part = Partition(i, n, num_experts, expert_nbytes, policy, self.stats, held=self.held)
            if n >= len(homed):  # every expert homed here fits: resident from the start
                part.preload(homed.tolist())
            self.parts.append(part)
        self._io = [_IO() for _ in self.parts]
        self._next_done = INF  # earliest done_at over self._io
        self.landed: list[int] = []  # keys landed since finish_layer last cleared it
        self.all_resident = all(len(p.key_slot) == int((self.home == p.index).sum()) for p in self.parts)
        # hybrid expert execution (moeserve.sim.hybrid.SimPlacer): places misses on the CPU or the link
        self.placer: Any = None

    @property
    def num_slots(self) -> int:
        return sum(p.num_slots for p in self.parts)

    # ------------------------------------------------------------------ the clock
    def advance(self, until: float | None = None) -> None:
        """Replay every I/O event up to ``until`` (default ``now``): landings and the next starts."""
        t = self.now if until is None else until
        if self._next_done > t:
            return
        for i, io in enumerate(self._io):
            while io.done_at <= t:
                at = io.done_at
                self.parts[i].land(io.slot, io.transfer)
                self.landed.append(io.transfer.key)
                io.transfer, io.done_at = None, INF
                self._start(i, at)
        ios = self._io
        self._next_done = ios[0].done_at if len(ios) == 1 else min(io.done_at for io in ios)

    def next_event(self) -> float:
        """Time of the earliest transfer completion (inf when every link is idle)."""
        return self._next_done

    def _start(self, i: int, at: float) -> None:
        """I/O thread ``i`` is idle at ``at``: take the next transfer it may start (``_io_loop``)."""
        part, io = self.parts[i], self._io[i]
        q = part.queue
        while True:
            t = q.peek()
            if t is None:
                return
            s = part.allocate(t)
            if s is not None:
                break
            if t.demand:
                return  # waits for the compute side to release a slot
            q.cancel(t.key)  # nothing evictable for a prefetch: drop it
            self.stats.prefetch_cancelled += 1
        q.pop()
        io.slot, io.transfer, io.done_at = s, t, at + self.transfer_s
        if io.done_at < self._next_done:
            self._next_done = io.done_at

    def _kick(self, i: int) -> None:
        if self._io[i].transfer is None:
            self._start(i, self.now)

    def _catch_up(self) -> None:
        """Replay the I/O that finished by ``now`` before a plan reads the buffer."""
        if self._next_done <= self.now:
            self.advance()

    def _kick_idle(self) -> None:
        """Start the next transfer on every idle I/O thread (``_kick`` of each), after a plan."""
        for i, io in enumerate(self._io):
            if io.transfer is None:
                self._start(i, self.now)

    # ------------------------------------------------------------------ policy interface
    def prefetch_capacity(self) -> int:
        """Slots prefetches could fill now, over all devices (caller holds ``cond``)."""
        return prefetch_capacity(self.parts)

    def resident(self, layer: int, expert: int) -> bool:
        key = layer * self.num_experts + expert
        self.advance()
        return self.parts[self._home[key]].ready_slot(key) is not None

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """Forward the layer's routing to the cache policies; advance the oracle's cursor."""
        self.advance()
        if self.oracle is not None:
            self.oracle.advance(layer)
        for part in self.parts:
            part.policy.after_routing(layer, request_ids, topk_ids)

    def prefetch(self, keys: np.ndarray, priorities: np.ndarray, replace: bool = True) -> None:
        """Queue prefetches of ``keys [n]`` with ``priorities [n]`` (``ExpertBuffer.prefetch``, same
        rules)."""
        self._catch_up()
        apply_prefetch_plan(self.parts, self.home, keys, priorities, replace, self.stats, now=self.now)
        self._kick_idle()

    def prefetch_best(
        self, scores: np.ndarray, first_key: int, limit: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``ExpertBuffer.prefetch_best``, same rules (``partition.apply_best_plan``; ``limit``
        None: :meth:`prefetch_capacity` once the clock is replayed to ``now``)."""
        self._catch_up()
        if limit is None:
            limit = self.prefetch_capacity()
        keys, best, _ = apply_best_plan(
            self.parts, self.home, self.held, scores, first_key, limit, self.stats, now=self.now
        )
        self._kick_idle()
        return keys, best

    def prefetch_ranked(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """``ExpertBuffer.prefetch_ranked``, same rules (``partition.apply_ranked_plan``, up to
        :meth:`prefetch_capacity` once the clock is replayed to ``now``)."""
        self._catch_up()
        limit = self.prefetch_capacity()
        apply_ranked_plan(self.parts, self.home, self.held, keys, priorities, limit, self.stats, now=self.now)
        self._kick_idle()

    # ------------------------------------------------------------------ compute side
    def run_layer(self, layer: int, experts: list[int], compute_s: Callable[[int], float]) -> float:
        """Run MoE layer ``layer`` needing ``experts`` (ascending ids); ``compute_s(e)`` is the
        seconds expert ``e`` computes. Advances ``now`` past the layer; returns its blocking seconds."""
        return self.finish_layer(layer, self.start_layer(layer, experts), compute_s)

    def start_layer(
        self, layer: int, experts: list[int], counts: np.ndarray | None = None
    ) -> tuple[list, list]:
        """Look the layer's experts up at ``now`` (``ExpertBuffer.start_layer``): pin hits, queue
        misses as demand and start the idle links. Returns ``(ready, waiting)`` for
        :meth:`finish_layer`; the engine runs the prefetch policy in between, as the runtime.
        With a :attr:`placer` (hybrid execution) ``counts [E]``, the token rows per expert, is
        required: the misses it places on the CPU are taken out of the lookup."""
        E, st, parts, home = self.num_experts, self.stats, self.parts, self._home
        base = layer * E
        if self.access_log is not None:
            self.access_log.append((layer, tuple(experts)))
        if self._next_done <= self.now:
            self.advance()
        if st.prefetch_issued:  # no slot is an unused prefetch before the first prefetch
            needed = None
            for part in parts:
                if part.has_unused_prefetch():  # settle_prefetches is a no-op otherwise
                    needed = needed or {base + e for e in experts}
                    part.settle_prefetches(layer, needed)
        if self.placer is not None:
            experts = self.placer.split(layer, experts, counts)
        ready: list[tuple[int, Partition, int]] = []
        waiting: list[tuple[int, int, Partition]] = []  # (expert, key, partition)
        keys = [base + e for e in experts]
        found = look_up_layer(parts, home, keys, layer, self.now)  # the runtime's own lookup
        for e, key, (part, s) in zip(experts, keys, found):
            if s is not None:
                ready.append((e, part, s))
            else:
                waiting.append((e, key, part))
        if waiting:
            for i in range(len(parts)):
                self._kick(i)
        return ready, waiting

    def finish_layer(self, layer: int, run: tuple[list, list], compute_s: Callable[[int], float]) -> float:
        """Compute the experts of ``start_layer``'s ``run``: resident first, then each as it lands,
        while the CPU lanes run the experts placed there (hybrid execution); the compute thread
        waits for the last of those after its own. Advances ``now`` past the layer; returns its
        blocking seconds (waiting for copies)."""
        placer = self.placer
        if placer is None or not placer.jobs:
            return self._finish_device(layer, run, compute_s)
        cpu_end = placer.run_jobs(self.now)
        blocked = self._finish_device(layer, run, compute_s)
        if cpu_end > self.now:
            self.stats.cpu_wait_s += cpu_end - self.now
            self.now = cpu_end
        return blocked

    def _finish_device(self, layer: int, run: tuple[list, list], compute_s: Callable[[int], float]) -> float:
        """The device's part of :meth:`finish_layer`."""
        ready, waiting = run
        st = self.stats
        if self._next_done <= self.now:
            self.advance()
        ios = self._io
        for e, part, s in ready:  # (the release is inlined here and below: once per lookup)
            now = self.now = self.now + compute_s(e)
            if self._next_done <= now:
                self.advance()
            part.release(s)
            if ios[part.index].transfer is None:
                self._start(part.index, now)
        if not waiting:
            self.landed.clear()  # nobody waits on these
            return 0.0
        # Waiting experts compute in list order among those READY (``ExpertBuffer._landed``). A slot turns
        # READY only by landing, so after one scan only the keys landed since are looked at: the
        # READY ones wait in a heap of their list positions.
        landed = self.landed
        landed.clear()
        ready_pos = [i for i, (_, key, part) in enumerate(waiting) if part.ready_slot(key) is not None]
        position = {key: i for i, (_, key, _) in enumerate(waiting)}
        seen = 0
        blocked_total = 0.0
        for _ in range(len(waiting)):
            t0 = self.now
            if self._next_done <= t0:
                self.advance()
            woke = False
            while True:
                if seen < len(landed):
                    for key in landed[seen:]:
                        i = position.get(key)
                        if i is not None:
                            heapq.heappush(ready_pos, i)
                    seen = len(landed)
                if ready_pos:
                    break
                if self._next_done == INF:
                    raise RuntimeError(f"simulator deadlock at layer {layer}: nothing in flight")
                self.now = self._next_done
                self.advance()
                woke = True
            if woke and self.wake_s:
                self.now += self.wake_s
            e, key, part = waiting[heapq.heappop(ready_pos)]
            blocked = self.now - t0
            if blocked:
                blocked_total += blocked
                st.blocking_s[layer] += blocked
                st.device_blocking_s[part.index] += blocked
            now = self.now = self.now + compute_s(e)
            if self._next_done <= now:
                self.advance()
            part.release(part.key_slot[key])
            if ios[part.index].transfer is None:
                self._start(part.index, now)
        return blocked_total
