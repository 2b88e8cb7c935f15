"""The slots of one device partition: their states and which of them may be evicted.

A slot is FREE, LOADING (a copy is in flight into it) or READY. A READY slot may be evicted unless
it is pinned (the running layer will use or is using it) or, by a prefetch, while it holds a
prefetched expert that was not used yet (MoE-Infinity §5.2). :class:`SlotTable` holds the per-slot
state and keeps the evictable slots up to date; the transitions between the states are
:class:`~moe_runtime.buffer.partition.Partition`'s, which calls :meth:`SlotTable._refresh` after
every change of a slot's state, pins or protection.

Speed: the evictable slots are kept incrementally (O(1) per change) instead of scanning all slots
per allocation. For policies whose victim is the lowest ``priority`` and whose priorities change
only in the slot hooks (``CachePolicy.ordered``: LRU, EAM), the evictable slots sit in two
lazy-deletion heaps keyed ``(priority, slot)`` (one for demands, one for prefetches), so a victim
costs O(log S) amortised and is the same slot ``argmin`` over the sorted candidates gives (lowest
priority, then lowest slot). Other policies get the sorted candidate array from a maintained
boolean mask.
"""

from __future__ import annotations

import heapq

import numpy as np

from moe_runtime.buffer.cache_base import CachePolicy

FREE, LOADING, READY = 0, 1, 2
# evictability of a slot (``SlotTable._ev``): not at all, by a demand only (an unused prefetch), by any
_NO, _DEMAND_ONLY, _ANY = 0, 1, 2


class SlotTable:
    """Per-slot state of one device's ``num_slots`` slots and the cache policy's victims among them.

    Attributes:
        slot_key: ``[S]`` list, flat expert key (``layer * E + expert``) held by each slot, -1 when free.
        state: ``[S]`` list, FREE / LOADING / READY.
        pins: ``[S]`` list, users that must see the slot unchanged (the running layer's compute).
            Change it only through ``Partition.pin`` / ``unpin`` / ``release`` (evictability).
        prefetched: ``[S]`` list, landed by a prefetch and not used yet: protected from prefetches.
        unused: ``[S]`` list, landed by a prefetch and never used since: counted as wasted if evicted.
        key_slot: flat key -> slot for LOADING and READY slots (the residency map).
        free: FREE slots, taken from the end (lowest slot first).
        policy: the cache policy choosing victims; its ``on_order_change`` is set here.
    """

    def __init__(self, num_slots: int, policy: CachePolicy) -> None:
        self.slot_key: list[int] = [-1] * num_slots
        self.state: list[int] = [FREE] * num_slots
        self.pins: list[int] = [0] * num_slots
        self.prefetched: list[bool] = [False] * num_slots
        self.unused: list[bool] = [False] * num_slots
        self.key_slot: dict[int, int] = {}
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.policy = policy
        # evictable-slot bookkeeping (see the module note)
        self._ev: list[int] = [_NO] * num_slots
        self._n_ev = [0, 0, 0]  # slots per evictability (_NO entry unused)
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
