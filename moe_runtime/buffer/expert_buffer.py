"""The expert buffer: experts run only from device slots; misses are fetched on demand.

NOTE: how a layer gets its experts (MoE-Infinity §5.1–5.2, Klotski §5 for the order).
``run_layer(layer, experts)`` pins every needed expert that is resident and yields those first, so
compute starts while missing experts load. Missing experts are queued as *demand* transfers, which
jump every queued prefetch; a queued prefetch of a needed expert is upgraded to demand. As each
lands it is yielded; after the caller computes with it, the slot is unpinned and handed to the
cache policy. When a layer needs more experts than there are slots, the I/O thread waits for the
compute thread to release one, so any buffer of at least one slot makes progress. The time the
compute thread spends waiting is the blocking time. Weights are read-only: eviction never copies
back to the host.

Threads: one I/O thread per device partition (``_io_loop``); one lock/condition shared by all
partitions, so the compute thread can wait for "any of my experts landed" across devices. The slot
state machine itself lives in :class:`~moe_runtime.buffer.partition.Partition` (shared with the
simulator).

NOTE: I/O rounds. An I/O thread takes a transfer and, if it is a demand fetch, the demand fetches
queued behind it (up to :data:`MAX_COPY_BATCH`) in one hold of the lock, then starts all their
copies: on CUDA they run back to back on its copy stream, each landed as its event completes; a
memcpy (no link emulation) has landed them all on return, so they are marked READY together and
the compute thread is woken once and runs them as one batch. A prefetch is taken alone, so a
demand queued meanwhile never waits behind a round of prefetches. With one copy per round, each
landing cost a lock round-trip and a wake-up of each thread, which on this 2-core host took more
than the 96 KiB memcpy itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from moe_runtime.buffer.cache_policy import make_cache_policy
from moe_runtime.buffer.layer_run import ExpertHandle, IOThreadError, LayerRun, ResidentRun, handle
from moe_runtime.buffer.partition import Partition
from moe_runtime.buffer.placement import home_devices
from moe_runtime.buffer.plans import (
    apply_best_plan,
    apply_prefetch_plan,
    apply_ranked_plan,
    look_up_layer,
    prefetch_capacity,
)
from moe_runtime.device import normalize_device
from moe_runtime.io.link import LinkModel
from moe_runtime.io.transfer_queue import Transfer
from moe_runtime.stats import ExpertStats
from moe_runtime.store import HostExpertStore

# Demand fetches one I/O round takes at once (see the module note).
MAX_COPY_BATCH = 8


class ExpertBuffer:
    """Fixed slots per device holding experts for compute.

    Args:
        store: the host expert store (source of every transfer).
        devices: one entry per device partition (the same CPU device may repeat to emulate several);
            ``cuda`` means the current CUDA device (:func:`~moe_runtime.device.normalize_device`).
        slots_per_device: slots in each partition (>= 1).
        cache_policy: registry name (``lru``, ``eam``, ...).
        link: ``(gbps, latency_us)`` to emulate a link per device, or None.
        policy_context: extra constructor arguments for the cache policy (``recorder``, ...).
    """

    def __init__(
        self,
        store: HostExpertStore,
        devices: list[torch.device],
        slots_per_device: int,
        cache_policy: str = "lru",
        link: tuple[float, float] | None = None,
        policy_context: dict[str, Any] | None = None,
    ) -> None:
        self.store = store
        devices = [normalize_device(d) for d in devices]  # I/O threads need indexed CUDA devices
        self.num_layers, self.num_experts = store.num_layers, store.num_experts
        total = self.num_layers * self.num_experts
        self.home = home_devices(self.num_layers, self.num_experts, len(devices))
        self._home = self.home.tolist()  # device per flat key, as Python ints (per-lookup use)
        self.stats = ExpertStats(self.num_layers, len(devices))
        self.cond = threading.Condition()
        self._closing = False
        # I/O threads waiting for the compute thread to release a slot (a demand fetch with
        # nothing evictable): a release wakes the I/O threads only then (_release_all)
        self._slot_waiters = 0
        self._io_error: tuple[Partition, BaseException] | None = None  # set by a dying I/O thread
        self.parts: list[Partition] = []
        ctx = {"num_layers": self.num_layers, **(policy_context or {})}
        self.oracle = ctx.get("oracle")  # an OracleSchedule whose cursor follows the routed layers
        self.access_log: list[tuple[int, tuple[int, ...]]] | None = None  # set to [] to record
        self.held = np.zeros(total, dtype=bool)  # keys resident or loading on any device
        for i, dev in enumerate(devices):
            homed = np.flatnonzero(self.home == i)
            n = max(1, min(slots_per_device, len(homed)))
            alias = len(devices) == 1 and dev.type == "cpu" and n >= total and link is None
            slots = (
                store.data
                if alias
                else torch.empty((n, store.expert_numel), dtype=store.data.dtype, device=dev)
            )
            policy = make_cache_policy(cache_policy, n, self.num_experts, **ctx)
            part = Partition(
                i,
                n,
                self.num_experts,
                store.expert_nbytes,
                policy,
                self.stats,
                dev,
                slots,
                store.hidden_size,
                store.intermediate_size,
                LinkModel(*link) if link else None,
                self.held,
                store.layout,
                store.compute_dtype,
            )
            self.parts.append(part)
            if n >= len(homed):  # every expert homed here fits: load all once, up front
                if not alias:
                    for s, key in enumerate(homed.tolist()):
                        part.slots[s].copy_(store.expert(key))
                part.preload(homed.tolist())
        # hybrid expert execution (moe_runtime.hybrid.placement.HybridPlacer): places each layer's
        # misses on the CPU or the link in start_layer; None = every miss is copied (device mode)
        self.placer: Any = None
        self.all_resident = all(len(p.key_slot) == int((self.home == p.index).sum()) for p in self.parts)
        # all resident: every expert's handle, by key, made once (slots never change)
        self._resident_handles = (
            [
                handle(key % self.num_experts, part, part.key_slot[key], True, 0.0)
                for key, part in ((key, self.parts[d]) for key, d in enumerate(self.home.tolist()))
            ]
            if self.all_resident
            else []
        )
        self._threads = [
            threading.Thread(target=self._io_loop, args=(p,), name=f"moeserve-io-{p.index}", daemon=True)
            for p in self.parts
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop the I/O threads (idempotent)."""
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    @property
    def num_slots(self) -> int:
        return sum(p.num_slots for p in self.parts)

    @property
    def copy_seconds(self) -> float | None:
        """Seconds one expert copy takes, as the I/O threads timed them (the devices' running
        means averaged; ``Partition.copy_s_mean``), or None before any copy landed. The prefetch
        gate's link time per copy: the link as the I/O threads measured it, not as configured."""
        means = [p.copy_s_mean for p in self.parts if p.copy_s_mean is not None]
        return sum(means) / len(means) if means else None

    @property
    def copy_host_seconds(self) -> float | None:
        """Seconds of the I/O threads' own CPU time per copy, outside the copy and the link's
        wait (picking it, evicting for it, landing it; ``Partition.copy_host_s_mean``, averaged
        over the devices), or None before any copy landed. That work holds the GIL: the prefetch
        gate's ``h``, what a prefetch overlapping the compute thread's work costs it."""
        means = [p.copy_host_s_mean for p in self.parts if p.copy_host_s_mean is not None]
        return sum(means) / len(means) if means else None

    @property
    def cpu_miss_seconds(self) -> float | None:
        """With hybrid execution (``auto``), the CPU's seconds for one miss (the prefetch gate's
        blocking per miss is at most this); else None."""
        return None if self.placer is None else self.placer.cpu_miss_seconds

    def partition_of(self, key: int) -> Partition:
        return self.parts[self.home[key]]

    def resident(self, layer: int, expert: int) -> bool:
        key = layer * self.num_experts + expert
        with self.cond:
            return self.partition_of(key).ready_slot(key) is not None

    def prefetch_capacity(self) -> int:
        """Slots prefetches could fill now, over all devices (caller holds ``cond``)."""
        return prefetch_capacity(self.parts)

    # ------------------------------------------------------------------ compute side
    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """Forward the layer's routing to the cache policies (e.g. EAM counts)."""
        with self.cond:
            if self.oracle is not None:
                self.oracle.advance(layer)
            for part in self.parts:
                part.policy.after_routing(layer, request_ids, topk_ids)

    def run_layer(self, layer: int, experts: list[int]) -> Iterator[ExpertHandle]:
        """Yield the layer's needed experts, resident ones first, then each as it lands.

        The caller must finish using a handle before asking for the next one: the slot is
        released then. Closing the generator early releases everything it held. The lookups
        happen at the first ``next``; :meth:`start_layer` does them at once.
        """
        run = self.start_layer(layer, experts)
        try:
            yield from run
        finally:
            run.close()

    def start_layer(
        self, layer: int, experts: list[int], counts: np.ndarray | None = None
    ) -> LayerRun | ResidentRun:
        """Look the layer's experts up now: pin the resident ones, queue demand fetches for the
        missing ones (the I/O thread starts on them at once); iterate the result for the handles
        as in :meth:`run_layer` (or its ``batches()``) and ``close()`` it when done. The MoE block
        calls this before the
        prefetch policy plans the later layers, so planning overlaps this layer's demand copies
        and a prefetch can no longer evict an expert this layer is about to use.

        With a :attr:`placer` (hybrid execution) ``counts [E]``, the token rows per expert, is
        required: the misses placed on the CPU are taken out of the lookup (no copy, no slot) and
        come back as the run's ``cpu``.
        """
        E = self.num_experts
        self.check_io()
        if self.access_log is not None:
            self.access_log.append((layer, tuple(experts)))
        if self.all_resident:  # nothing is ever evicted: no pins, locks or policy hooks needed
            return self._run_resident(layer, experts)
        ready: list[tuple[int, Partition, int]] = []
        waiting: list[tuple[int, Partition]] = []
        cpu = None
        with self.cond:
            keys = [layer * E + e for e in experts]
            needed = set(keys)
            for part in self.parts:
                part.settle_prefetches(layer, needed)
            if self.placer is not None:
                experts, keys, cpu, _ = self.placer.split(layer, experts, keys, counts)
            # pins a hit or in-flight copy; queues a demand fetch
            for e, (part, s) in zip(experts, look_up_layer(self.parts, self._home, keys, layer)):
                if s is not None:
                    ready.append((e, part, s))
                else:
                    waiting.append((e, part))
            if waiting:
                self.cond.notify_all()
        run = LayerRun(self, layer, ready, waiting)
        if self.placer is not None:
            run.cpu = cpu
            self.placer.bind(run)
        return run

    def _run_resident(self, layer: int, experts: list[int]) -> ResidentRun:
        st, n, key0 = self.stats, len(experts), layer * self.num_experts
        handles = [self._resident_handles[key0 + e] for e in experts]
        with self.cond:
            st.lookups[layer] += n
            st.hits[layer] += n
            st.expert_batches[layer] += 1 if n else 0  # a ResidentRun is one batch
            if len(self.parts) == 1:
                st.device_lookups[0] += n
                st.device_hits[0] += n
            else:
                for h in handles:
                    st.device_lookups[h.part.index] += 1
                    st.device_hits[h.part.index] += 1
        return ResidentRun(handles)

    def _landed(self, layer: int, waiting: list[tuple[int, Partition]]) -> list[int]:
        """Indices into ``waiting`` of the experts READY now (caller holds ``cond``)."""
        key0 = layer * self.num_experts
        return [i for i, (e, part) in enumerate(waiting) if part.ready_slot(key0 + e) is not None]

    def _release_all(self, held: list[tuple[Partition, int]]) -> None:
        """The compute thread finished with the experts in these ``(partition, slot)`` pairs."""
        events = {}
        for part, _ in held:  # one release event per partition, recorded after the batch's kernels
            if part.index not in events:
                events[part.index] = part.copier.release_event()
        with self.cond:
            for part, s in held:
                part.release_events[s] = events[part.index]
                part.release(s)
            if self._slot_waiters:
                # Only an I/O thread waiting for a slot needs the wake-up: waking the others
                # (queues empty) at every batch's release cost the compute thread the GIL
                # while each woke, looked and slept again.
                self.cond.notify_all()

    def check_io(self) -> None:
        """Raise :class:`IOThreadError` if an I/O thread died (its copies will never land)."""
        if self._io_error is not None:
            part, exc = self._io_error
            raise IOThreadError(
                f"the expert I/O thread of device {part.index} ({part.device}) died: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _abandon(self, layer: int, waiting: list[tuple[int, Partition]]) -> None:
        """Undo demand for experts never consumed (the layer run was closed early)."""
        with self.cond:
            for e, part in waiting:
                key = layer * self.num_experts + e
                if part.queue.cancel(key) is None and (s := part.key_slot.get(key)) is not None:
                    part.unpin(s)
            self.cond.notify_all()

    # ------------------------------------------------------------------ prefetch side
    def prefetch(self, keys: Sequence[int], priorities: Sequence[float], replace: bool = True) -> None:
        """Queue prefetches of distinct flat expert ``keys [n]`` with ``priorities [n]`` (higher
        first).

        With ``replace``, queued prefetches that are not in the plan are cancelled (in-flight ones
        finish). Keys already resident or loading are skipped. Caller may hold ``cond``.
        """
        with self.cond:
            if apply_prefetch_plan(self.parts, self.home, keys, priorities, replace, self.stats):
                self.cond.notify_all()  # a prefetch was queued or cancelled: wake the I/O threads

    def prefetch_best(
        self, scores: np.ndarray, first_key: int, limit: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Queue as the prefetch plan (replacing the queued one, as :meth:`prefetch` with
        ``replace``) the best ``limit`` (None: :meth:`prefetch_capacity`, read in the same hold
        of the lock) positive entries of ``scores [n]`` (flat keys ``first_key ..``) that are not
        resident or loading (``partition.apply_best_plan``). Returns ``(keys [m], scores [m])``,
        best first. The I/O threads are woken only when a prefetch was queued or cancelled.
        Caller may hold ``cond``."""
        with self.cond:
            if limit is None:
                limit = self.prefetch_capacity()
            keys, best, changed = apply_best_plan(
                self.parts, self.home, self.held, scores, first_key, limit, self.stats
            )
            if changed:
                self.cond.notify_all()
        return keys, best

    def prefetch_ranked(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Queue as the prefetch plan (replacing the queued one) the first
        :meth:`prefetch_capacity` (read in the same hold of the lock) of ``keys [n]`` (int64,
        distinct, best first) that are not resident or loading, with ``priorities [n]``
        (float64; ``partition.apply_ranked_plan``): :meth:`prefetch_best` for a plan its policy
        ranked itself. The I/O threads are woken only when a prefetch was queued or cancelled.
        Caller may hold ``cond``."""
        with self.cond:
            limit = self.prefetch_capacity()
            if apply_ranked_plan(self.parts, self.home, self.held, keys, priorities, limit, self.stats):
                self.cond.notify_all()

    # ------------------------------------------------------------------ I/O thread
    def _io_loop(self, part: Partition) -> None:
        """Run :meth:`_copy_loop`; if it fails, record the error and wake every waiter, which
        then raises it (:meth:`check_io`) instead of waiting forever."""
        try:
            self._copy_loop(part)
        except BaseException as exc:
            with self.cond:
                self._io_error = (part, exc)
                self.cond.notify_all()

    def _copy_loop(self, part: Partition) -> None:
        part.copier.bind_thread()
        if part.link is not None:
            part.link.bind_thread()  # sleeps that end nearer their deadlines (moe_runtime.io.link)
        nbytes, store, copier = self.store.expert_nbytes, self.store, part.copier
        memcpy = part.link is None and not copier.cuda  # a copy has landed when it returns
        cpu = time.thread_time  # the round's own work per copy (Partition.note_copy_host)
        while True:
            waited = False  # since the previous copy landed (see moe_runtime.io.link)
            batch: list[tuple[Transfer, int, Any]] = []  # (transfer, slot, slot's release event)
            c0, off = cpu(), 0.0  # off: CPU time of waits for work, the copies and the link's waits
            with self.cond:
                while not batch:
                    if self._closing:
                        return
                    t = part.queue.peek()
                    if t is None:
                        w0 = cpu()
                        self.cond.wait()
                        off += cpu() - w0
                        waited = True
                        continue
                    s = part.allocate(t)
                    if s is None:
                        if t.demand:
                            w0 = cpu()
                            self._slot_waiters += 1
                            try:
                                self.cond.wait()  # the compute thread will release a slot
                            finally:
                                self._slot_waiters -= 1
                            off += cpu() - w0
                            waited = True
                        else:
                            part.queue.cancel(t.key)  # nothing evictable for a prefetch: drop it
                            self.stats.prefetch_cancelled += 1
                        continue
                    part.queue.pop()
                    batch.append((t, s, part.release_events[s]))
                    # the demand fetches queued behind it go in the same round (one lock hold,
                    # copies back to back; see the module note)
                    while t.demand and len(batch) < MAX_COPY_BATCH:
                        t = part.queue.peek()
                        if t is None or not t.demand or (s := part.allocate(t)) is None:
                            break
                        part.queue.pop()
                        batch.append((t, s, part.release_events[s]))
            w0 = cpu()
            started = time.perf_counter()
            pending = [copier.start(part.slots[s], store.expert(t.key), after) for t, s, after in batch]
            off += cpu() - w0
            if memcpy:  # every copy is done: land them together, one wake-up
                with self.cond:
                    for (t, s, _), seconds in zip(batch, pending):
                        part.land(s, t, copier.wait(seconds))
                    self.cond.notify_all()
                part.note_copy_host(cpu() - c0 - off, len(batch))
                continue
            for i, ((t, s, _), done) in enumerate(zip(batch, pending)):
                w0 = cpu()
                seconds = copier.wait(done)
                if part.link is not None:
                    # straight on from the previous copy: this one was ready when it was queued,
                    # or when the previous one's link time ended, whichever is later
                    part.link.hold(nbytes, started, None if waited and i == 0 else t.queued_at)
                    seconds = part.link.transfer_seconds(nbytes)  # the emulated link's time
                off += cpu() - w0
                with self.cond:
                    part.land(s, t, seconds)
                    self.cond.notify_all()
            part.note_copy_host(cpu() - c0 - off, len(batch))
