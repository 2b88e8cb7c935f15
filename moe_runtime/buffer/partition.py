"""One device's share of the expert buffer: slots, residency map and the slot state machine.

A slot is FREE, LOADING (a copy is in flight into it) or READY. A READY slot is *protected* while
pinned (the running layer will use or is using it) or while it holds a prefetched expert that was
not used yet (MoE-Infinity §5.2: "being prefetched experts are given maximal cache priorities
until they are used or determined to not use"). Unprotected READY slots are evicted in the cache
policy's order. Weights are read-only, so eviction only forgets the slot's key.

This class is pure bookkeeping (no locks, no threads, no clocks): the runtime's
:class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer` drives it under its lock with real copies,
and the simulator drives the very same object with simulated time.

Speed: every change of a slot's state goes through this class, which keeps the evictable slots
incrementally (O(1) per change) instead of scanning all slots per allocation. For policies whose
victim is the lowest ``priority`` and whose priorities change only in the slot hooks
(``CachePolicy.ordered``: LRU, EAM), the evictable slots sit in two lazy-deletion heaps keyed
``(priority, slot)`` (one for demands, one for prefetches), so a victim costs O(log S) amortised
and is the same slot ``argmin`` over the sorted candidates gives (lowest priority, then lowest
slot). Other policies get the sorted candidate array from a maintained boolean mask.
"""

from __future__ import annotations

import heapq
import time

import numpy as np
import torch

from moe_runtime.buffer.cache_base import CachePolicy
from moe_runtime.io.copy_engine import CopyEngine
from moe_runtime.io.link import LinkModel
from moe_runtime.io.transfer_queue import Transfer, TransferQueue, best_free
from moe_runtime.quant.layout import DequantSlots, ExpertLayout
from moe_runtime.stats import ExpertStats

FREE, LOADING, READY = 0, 1, 2
# weight of the past in a partition's running mean of its copies' seconds (``Partition.land``)
COPY_DECAY = 0.9
# evictability of a slot (``Partition._ev``): not at all, by a demand only (an unused prefetch), by any
_NO, _DEMAND_ONLY, _ANY = 0, 1, 2


class Partition:
    """Slots of one device.

    Attributes:
        slots: ``[S, 3 * I * H]`` device tensor (or, when every expert fits on a single CPU device
            without link emulation, the host store itself: nothing is copied); None in simulation.
            Quantized experts (``layout``): ``[S, nbytes]`` uint8, and the views below are
            :class:`~moe_runtime.quant.layout.DequantSlots` that dequantize what they are indexed
            with to ``compute_dtype``.
        gate_up_all / down_all: ``[S, 2I, H]`` / ``[S, H, I]`` strided views of ``slots``;
            ``gate_up_t`` / ``down_t`` the same transposed (``[S, H, 2I]`` / ``[S, I, H]``), the
            right operand of the grouped expert GEMMs; ``gate_up`` / ``down`` per-slot lists.
        slot_key: ``[S]`` list, flat expert key (``layer * E + expert``) held by each slot, -1 when free.
        state: ``[S]`` list, FREE / LOADING / READY.
        pins: ``[S]`` list, users that must see the slot unchanged (the running layer's compute).
            Change it only through :meth:`pin` / :meth:`unpin` / :meth:`release` (evictability).
        prefetched: ``[S]`` list, landed by a prefetch and not used yet: protected from prefetches.
        unused: ``[S]`` list, landed by a prefetch and never used since: counted as wasted if evicted.
        key_slot: flat key -> slot for LOADING and READY slots (the residency map).
        held: ``[L * E]`` bool, True for keys LOADING or READY; the partitions of one buffer share
            it (pass ``held``), so a prefetch plan masks out resident keys in one operation.
        free: FREE slots, taken from the end (lowest slot first).
    """

    def __init__(
        self,
        index: int,
        num_slots: int,
        num_experts: int,
        expert_nbytes: int,
        policy: CachePolicy,
        stats: ExpertStats,
        device: torch.device | None = None,
        slots: torch.Tensor | None = None,
        hidden: int = 0,
        intermediate: int = 0,
        link: LinkModel | None = None,
        held: np.ndarray | None = None,
        layout: ExpertLayout | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.index = index
        self.device = device
        self.num_experts = num_experts
        self.expert_nbytes = expert_nbytes
        self.slots = slots
        if slots is not None and layout is not None:
            # quantized slots (uint8 rows): the same interface, each access dequantizes the
            # slots it names to ``compute_dtype`` (moe_runtime.quant.layout.DequantSlots)
            dt = compute_dtype or torch.float32
            self.gate_up = DequantSlots(layout, slots, "gate_up", dt)
            self.down = DequantSlots(layout, slots, "down", dt)
            self.gate_up_t = DequantSlots(layout, slots, "gate_up", dt, transposed=True)
            self.down_t = DequantSlots(layout, slots, "down", dt, transposed=True)
        elif slots is not None:
            # 3-D strided views of the flat slots (an expert stays one contiguous row, one copy);
            # the grouped expert kernels read them transposed, as column-major ``mat_b``.
            gu = 2 * intermediate * hidden
            self.gate_up_all = slots[:, :gu].unflatten(1, (2 * intermediate, hidden))  # [S, 2I, H]
            self.down_all = slots[:, gu:].unflatten(1, (hidden, intermediate))  # [S, H, I]
            self.gate_up_t = self.gate_up_all.transpose(1, 2)  # [S, H, 2I]
            self.down_t = self.down_all.transpose(1, 2)  # [S, I, H]
            self.gate_up = list(self.gate_up_all.unbind(0))  # per slot [2I, H]
            self.down = list(self.down_all.unbind(0))  # per slot [H, I]
        self.slot_key: list[int] = [-1] * num_slots
        self.state: list[int] = [FREE] * num_slots
        self.pins: list[int] = [0] * num_slots
        self.prefetched: list[bool] = [False] * num_slots
        self.unused: list[bool] = [False] * num_slots
        self.release_events: list[torch.cuda.Event | None] = [None] * num_slots
        self.key_slot: dict[int, int] = {}
        num_keys = len(stats.lookups) * num_experts
        self.held = held if held is not None else np.zeros(num_keys, dtype=bool)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.queue = TransferQueue(num_keys)
        self.policy = policy
        self.stats = stats
        self.link = link
        self.copier = CopyEngine(device) if device is not None else None
        # running mean of this device's copies' seconds, timed by its I/O thread (land); None
        # before the first
        self.copy_s_mean: float | None = None
        # running mean of the I/O thread's CPU seconds per copy outside the copy itself and the
        # link's wait (picking, the victim, landing: Python that holds the GIL); None before the first
        self.copy_host_s_mean: float | None = None
        # evictable-slot bookkeeping (see the module note)
        self._ev: list[int] = [_NO] * num_slots
        self._n_ev = [0, 0, 0]  # slots per evictability (_NO entry unused)
        self._protected: dict[int, set[int]] = {}  # layer -> READY slots with ``prefetched`` set
        self._ordered = bool(getattr(policy, "ordered", False))
        self._stamp: list[int] = [0] * num_slots  # heap entries of a slot are valid at its stamp
        self._heap_demand: list[tuple[float, int, int]] = []  # (priority, slot, stamp)
        self._heap_prefetch: list[tuple[float, int, int]] = []
        self._heap_limit = 4 * num_slots + 64  # stale entries beyond this: rebuild the heaps
        self._mask_demand = np.zeros(num_slots, dtype=bool)  # non-ordered policies: evictable masks
        self._mask_prefetch = np.zeros(num_slots, dtype=bool)
        # a non-ordered policy that takes the mask itself (``eam-reuse``: one compiled call)
        self._victim_of = getattr(policy, "victim_of", None)
        policy.on_order_change = self._reorder

    @property
    def num_slots(self) -> int:
        return len(self.slot_key)

    def ready_slot(self, key: int) -> int | None:
        s = self.key_slot.get(key)
        return s if s is not None and self.state[s] == READY else None

    def evictable(self, for_demand: bool) -> np.ndarray:
        """Slots that may be taken (ascending): ready, unpinned and (for prefetches) not an unused
        prefetch."""
        need = _DEMAND_ONLY if for_demand else _ANY
        return np.array([s for s, ev in enumerate(self._ev) if ev >= need], dtype=np.int64)

    def capacity_for_prefetch(self) -> int:
        """Slots a prefetch could take now: free ones plus evictable ones."""
        return len(self.free) + self._n_ev[_ANY]

    def has_unused_prefetch(self) -> bool:
        """Some READY slot holds a prefetch its layer has not run with yet."""
        return bool(self._protected)

    def preload(self, keys: list[int]) -> None:
        """Mark ``keys`` resident in slots ``0..len(keys)-1`` (the caller filled the memory)."""
        for s, key in enumerate(keys):
            self.slot_key[s], self.state[s] = key, READY
            self.key_slot[key] = s
            self.held[key] = True
            self.policy.on_fill(s, key, prefetch=False)
            self._refresh(s, True)
        self.free = list(range(self.num_slots - 1, len(keys) - 1, -1))

    # ------------------------------------------------------------------ evictable bookkeeping
    def _refresh(self, s: int, reprioritised: bool) -> None:
        """Slot ``s`` changed state, pins or protection (and, if ``reprioritised``, its policy
        priority): update its evictability, the counters and the victim heaps or masks."""
        if self.state[s] == READY and self.pins[s] == 0:
            ev = _DEMAND_ONLY if self.prefetched[s] else _ANY
        else:
            ev = _NO
        old = self._ev[s]
        if old == ev and (not reprioritised or ev == _NO):  # a slot not evictable has no heap entry
            return
        if old != ev:
            n = self._n_ev
            n[old] -= 1
            n[ev] += 1
            self._ev[s] = ev
            if not self._ordered:
                self._mask_demand[s] = ev != _NO
                self._mask_prefetch[s] = ev == _ANY
        if not self._ordered:
            return
        stamp = self._stamp[s] + 1
        self._stamp[s] = stamp
        if ev == _NO:
            return
        entry = (self.policy.priority[s], s, stamp)
        heapq.heappush(self._heap_demand, entry)
        if ev == _ANY:
            heapq.heappush(self._heap_prefetch, entry)
        if len(self._heap_demand) > self._heap_limit:
            self._compact()

    def _compact(self) -> None:
        """Rebuild both heaps from the evictable slots (drops stale entries)."""
        prio, stamp = self.policy.priority, self._stamp
        live = [(prio[s], s, stamp[s]) for s, ev in enumerate(self._ev) if ev != _NO]
        pre = [e for e in live if self._ev[e[1]] == _ANY]
        heapq.heapify(live)
        heapq.heapify(pre)
        self._heap_demand, self._heap_prefetch = live, pre

    def _reorder(self) -> None:
        """The policy's ``ordered`` changed (caller holds the buffer lock): rebuild the victim
        heaps, or the evictable masks, which are not kept up to date meanwhile."""
        ordered = bool(self.policy.ordered)
        if ordered == self._ordered:
            return
        self._ordered = ordered
        if ordered:
            self._compact()
        else:
            ev = np.asarray(self._ev)
            self._mask_demand[:] = ev != _NO
            self._mask_prefetch[:] = ev == _ANY

    def _victim(self, for_demand: bool) -> int | None:
        """The cache policy's victim among the evictable slots, or None when there is none."""
        if self._n_ev[_ANY] + (self._n_ev[_DEMAND_ONLY] if for_demand else 0) == 0:
            return None
        if not self._ordered:
            mask = self._mask_demand if for_demand else self._mask_prefetch
            if self._victim_of is not None:
                return self._victim_of(mask)
            return self.policy.victim(mask.nonzero()[0])  # ascending slots (no np.flatnonzero wrapper)
        heap, stamp = (self._heap_demand if for_demand else self._heap_prefetch), self._stamp
        while True:  # non-empty: an evictable slot always has a live entry
            _, s, st = heap[0]
            if stamp[s] == st:
                return s
            heapq.heappop(heap)

    def _unprotect(self, s: int, key: int) -> None:
        self.prefetched[s] = False
        layer = key // self.num_experts
        slots = self._protected[layer]
        slots.discard(s)
        if not slots:
            del self._protected[layer]

    # ------------------------------------------------------------------ I/O side
    def allocate(self, t: Transfer) -> int | None:
        """Take a free slot or evict the cache policy's victim for transfer ``t``; None when
        nothing may be taken."""
        if self.free:
            s = self.free.pop()
        else:
            s = self._victim(t.demand)
            if s is None:
                return None
            old = self.slot_key[s]
            self.policy.on_evict(s, old)
            del self.key_slot[old]
            self.held[old] = False
            if self.unused[s]:
                self.stats.prefetch_wasted_bytes += self.expert_nbytes
            if self.prefetched[s]:
                self._unprotect(s, old)
            self.unused[s] = False
        self.slot_key[s], self.state[s] = t.key, LOADING
        self.key_slot[t.key] = s
        self.held[t.key] = True
        if t.demand:
            self.pins[s] += 1  # the waiting compute thread holds it until it has used it
        self._refresh(s, False)
        return s

    def land(self, s: int, t: Transfer, copy_s: float | None = None) -> None:
        """The copy of transfer ``t`` into ``s`` completed, taking ``copy_s`` seconds by the I/O
        thread's own timing (:class:`~moe_runtime.io.copy_engine.CopyEngine`; the emulated link's
        time with one; None: not timed, the simulator)."""
        if copy_s is not None:
            self.stats.copies += 1
            self.stats.copy_s += copy_s
            m = self.copy_s_mean
            # a running mean; a repeated figure (an emulated link's) leaves it exactly as it is
            self.copy_s_mean = copy_s if m is None else m + (1 - COPY_DECAY) * (copy_s - m)
        self.state[s] = READY
        prefetch = not t.demand
        self.prefetched[s] = self.unused[s] = prefetch
        if prefetch:
            self._protected.setdefault(t.key // self.num_experts, set()).add(s)
            self.stats.prefetch_bytes += self.expert_nbytes
        else:
            self.stats.demand_bytes += self.expert_nbytes
        self.policy.on_fill(s, t.key, prefetch=prefetch)
        self._refresh(s, True)

    def note_copy_host(self, seconds: float, copies: int) -> None:
        """The I/O thread spent ``seconds`` of its own CPU time outside the copies and the
        link's waits on a round of ``copies`` copies (:attr:`copy_host_s_mean`)."""
        per = seconds / copies
        m = self.copy_host_s_mean
        self.copy_host_s_mean = per if m is None else m + (1 - COPY_DECAY) * (per - m)

    # ------------------------------------------------------------------ compute side
    def pin(self, s: int) -> None:
        """The running layer will use the expert in ``s`` (READY or LOADING): keep it."""
        self.pins[s] += 1
        self._refresh(s, False)

    def look_up(self, keys: list[int], layer: int, queued_at: float | None = None) -> list[int | None]:
        """The running layer needs ``keys`` (experts of MoE layer ``layer``) homed here, in order.

        Counts the lookups in the stats. Per key: resident: pins it and gives its slot (a hit);
        loading: pins it (a late prefetch); queued or absent: queues a demand fetch, which replaces
        a queued prefetch (stamped ``queued_at`` when given, for simulated time). Both give None:
        the caller waits for the slot to turn READY. One call per layer keeps the per-lookup
        cost down (the stats are added once).
        """
        key_slot, state, pins, unused, refresh = (
            self.key_slot,
            self.state,
            self.pins,
            self.unused,
            self._refresh,
        )
        out: list[int | None] = []
        hits = hits_prefetched = late = demand = 0
        for key in keys:
            s = key_slot.get(key)
            if s is None:
                at = time.perf_counter() if queued_at is None else queued_at
                self.queue.push(Transfer(key, True, queued_at=at))
                demand += 1
                out.append(None)
                continue
            pins[s] += 1  # as pin(): the running layer keeps it
            refresh(s, False)
            if state[s] == READY:
                hits += 1
                hits_prefetched += unused[s]
                out.append(s)
            else:  # its prefetch is in flight
                late += 1
                out.append(None)
        st, d = self.stats, self.index
        st.lookups[layer] += len(keys)
        st.device_lookups[d] += len(keys)
        st.hits[layer] += hits
        st.device_hits[d] += hits
        st.hits_prefetched[layer] += hits_prefetched
        st.late_prefetches[layer] += late
        st.demand_fetches[layer] += demand
        return out

    def unpin(self, s: int) -> None:
        """Drop a pin without using the expert (an abandoned layer)."""
        self.pins[s] -= 1
        self._refresh(s, False)

    def release(self, s: int) -> None:
        """The compute thread finished using the expert in ``s``."""
        self.pins[s] -= 1
        if self.unused[s]:
            self.stats.prefetch_used += 1
            self.unused[s] = False
        key = self.slot_key[s]
        if self.prefetched[s]:
            self._unprotect(s, key)
        self.policy.on_use(s, key)
        self._refresh(s, True)

    def settle_prefetches(self, layer: int, needed: set[int]) -> None:
        """Layer ``layer`` is about to run: its prefetched experts it does not need turned out
        unused this time; they lose their protection and the policy resets their priority
        (in ascending slot order)."""
        slots = self._protected.get(layer)
        if not slots:
            return
        for s in sorted(slots):
            key = self.slot_key[s]
            if key not in needed:
                self._unprotect(s, key)
                self.policy.on_prefetch_unused(s, key)
                self._refresh(s, True)


def look_up_layer(
    parts: list[Partition],
    home: list[int],
    keys: list[int],
    layer: int,
    queued_at: float | None = None,
) -> list[tuple[Partition, int | None]]:
    """:meth:`Partition.look_up` of a layer's ``keys`` on their home partitions (``home [L * E]``
    device per key); ``(partition, slot or None)`` per key, in the order of ``keys``."""
    if len(parts) == 1:
        part = parts[0]
        return [(part, s) for s in part.look_up(keys, layer, queued_at)]
    owner = [home[k] for k in keys]
    out: list[tuple[Partition, int | None]] = [(parts[d], None) for d in owner]
    for d, part in enumerate(parts):
        idx = [i for i, o in enumerate(owner) if o == d]
        if idx:
            for i, s in zip(idx, part.look_up([keys[i] for i in idx], layer, queued_at)):
                out[i] = (part, s)
    return out


def prefetch_capacity(parts: list[Partition]) -> int:
    """Slots prefetches could fill now over ``parts`` (free plus evictable; caller holds the
    buffer's lock). Read at every planning layer: one device without a generator."""
    if len(parts) == 1:
        return parts[0].capacity_for_prefetch()
    return sum(p.capacity_for_prefetch() for p in parts)


def apply_prefetch_plan(
    parts: list[Partition],
    home: np.ndarray,
    keys: np.ndarray,
    priorities: np.ndarray,
    replace: bool,
    stats: ExpertStats,
    now: float | None = None,
) -> int:
    """Queue prefetches of distinct flat ``keys [n]`` with ``priorities [n]`` on each expert's home
    partition (MoE-Infinity §5.1).

    With ``replace``, queued prefetches not in the plan are cancelled (in-flight copies finish).
    Keys resident or loading are skipped; a queued transfer is re-prioritised only when its priority
    changed (a queued demand is never downgraded). ``home`` is ``[L * E]`` device per key; ``now``
    stamps new transfers (simulated time). Each partition's queue is re-planned in one bulk call
    (:meth:`TransferQueue.replan`). Returns the prefetches queued or cancelled (0: the I/O threads
    have nothing new to do).
    """
    keys = np.asarray(keys, dtype=np.int64)
    priorities = np.asarray(priorities, dtype=np.float64)
    if len(parts) == 1:
        groups = [(keys, priorities)]
    else:
        dev = home[keys]
        groups = [(keys[dev == i], priorities[dev == i]) for i in range(len(parts))]
    changed = 0
    for part, (k, p) in zip(parts, groups):
        if not k.size and not (replace and len(part.queue)):
            continue
        held = part.held[k]
        if np.count_nonzero(held):  # rare on the policies' path: ``issue`` skipped them already
            free = ~held
            k, p = k[free], p[free]
        issued, cancelled = part.queue.replan(k, p, replace, now)
        stats.prefetch_issued += issued
        stats.prefetch_cancelled += cancelled
        changed += issued + cancelled
    return changed


def apply_best_plan(
    parts: list[Partition],
    home: np.ndarray,
    held: np.ndarray,
    flat: np.ndarray,
    base: int,
    limit: int,
    stats: ExpertStats,
    now: float | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Queue the best ``limit`` positive entries of ``flat [n]`` (scores of flat keys ``base ..
    base + n - 1``) whose key is not ``held [L * E]`` (resident or loading anywhere) as the
    plan of :func:`apply_prefetch_plan` with ``replace`` (MoE-Infinity §5.1). One partition
    selects and re-plans in one compiled call (:meth:`TransferQueue.replan_best`); several select
    first (``best_free``) and re-plan per device. Returns ``(keys [m] best first, scores [m],
    changed)``: ``changed`` as :func:`apply_prefetch_plan` returns it."""
    window = held[base : base + flat.size]
    if len(parts) > 1:
        keys, scores = best_free(flat, window, limit)
        keys += base
        return keys, scores, apply_prefetch_plan(parts, home, keys, scores, True, stats, now)
    keys, scores, issued, cancelled = parts[0].queue.replan_best(flat, window, limit, base, True, now)
    stats.prefetch_issued += issued
    stats.prefetch_cancelled += cancelled
    return keys, scores, issued + cancelled


def apply_ranked_plan(
    parts: list[Partition],
    home: np.ndarray,
    held: np.ndarray,
    keys: np.ndarray,
    priorities: np.ndarray,
    limit: int,
    stats: ExpertStats,
    now: float | None = None,
) -> int:
    """Queue the first ``limit`` of the ranked plan ``keys [n]`` (int64, distinct, best first)
    whose key is not ``held [L * E]`` (resident or loading anywhere), with ``priorities [n]``
    (float64), as the plan of :func:`apply_prefetch_plan` with ``replace`` (MoE-Infinity §5.1):
    :func:`apply_best_plan` for a plan its policy ranked already. One partition re-plans in one
    compiled call (:meth:`TransferQueue.replan_ranked`); several drop the held keys first and
    re-plan per device. Returns ``changed`` as :func:`apply_prefetch_plan` returns it."""
    if len(parts) > 1:
        free = ~held[keys]
        keys, priorities = keys[free][:limit], priorities[free][:limit]
        return apply_prefetch_plan(parts, home, keys, priorities, True, stats, now)
    issued, cancelled = parts[0].queue.replan_ranked(keys, priorities, held, limit, True, now)
    stats.prefetch_issued += issued
    stats.prefetch_cancelled += cancelled
    return issued + cancelled
