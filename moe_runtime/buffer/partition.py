"""One device's share of the expert buffer: slots, residency map and the slot state machine.

A slot is FREE, LOADING (a copy is in flight into it) or READY. A READY slot is *protected* while
pinned (the running layer will use or is using it) or while it holds a prefetched expert that was
not used yet (MoE-Infinity §5.2: "being prefetched experts are given maximal cache priorities
until they are used or determined to not use"). Unprotected READY slots are evicted in the cache
policy's order. Weights are read-only, so eviction only forgets the slot's key.

This class is pure bookkeeping (no locks, no threads, no clocks): the runtime's
:class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer` drives it under its lock with real copies,
and the simulator drives the very same object with simulated time.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_runtime.buffer.cache_policy import CachePolicy
from moe_runtime.io.copy_engine import CopyEngine
from moe_runtime.io.link import LinkModel
from moe_runtime.io.transfer_queue import Transfer, TransferQueue
from moe_runtime.stats import ExpertStats

FREE, LOADING, READY = 0, 1, 2


class Partition:
    """Slots of one device.

    Attributes:
        slots: ``[S, 3 * I * H]`` device tensor (or, when every expert fits on a single CPU device
            without link emulation, the host store itself: nothing is copied); None in simulation.
        slot_key: ``[S]`` flat expert key (``layer * E + expert``) held by each slot, -1 when free.
        state: ``[S]`` FREE / LOADING / READY.
        pins: ``[S]`` users that must see the slot unchanged (the running layer's compute).
        prefetched: ``[S]`` landed by a prefetch and not used yet: protected from prefetches.
        unused: ``[S]`` landed by a prefetch and never used since: counted as wasted if evicted.
        key_slot: flat key -> slot for LOADING and READY slots (the residency map).
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
    ) -> None:
        self.index = index
        self.device = device
        self.num_experts = num_experts
        self.expert_nbytes = expert_nbytes
        self.slots = slots
        if slots is not None:
            gu = 2 * intermediate * hidden
            self.gate_up = [slots[s, :gu].view(2 * intermediate, hidden) for s in range(num_slots)]
            self.down = [slots[s, gu:].view(hidden, intermediate) for s in range(num_slots)]
        self.slot_key = np.full(num_slots, -1, dtype=np.int64)
        self.state = np.zeros(num_slots, dtype=np.int8)
        self.pins = np.zeros(num_slots, dtype=np.int32)
        self.prefetched = np.zeros(num_slots, dtype=bool)
        self.unused = np.zeros(num_slots, dtype=bool)
        self.release_events: list[torch.cuda.Event | None] = [None] * num_slots
        self.key_slot: dict[int, int] = {}
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.queue = TransferQueue()
        self.policy = policy
        self.stats = stats
        self.link = link
        self.copier = CopyEngine(device) if device is not None else None

    @property
    def num_slots(self) -> int:
        return len(self.slot_key)

    def ready_slot(self, key: int) -> int | None:
        s = self.key_slot.get(key)
        return s if s is not None and self.state[s] == READY else None

    def evictable(self, for_demand: bool) -> np.ndarray:
        """Slots that may be taken: ready, unpinned and (for prefetches) not an unused prefetch."""
        mask = (self.state == READY) & (self.pins == 0)
        if not for_demand:
            mask &= ~self.prefetched
        return np.flatnonzero(mask)

    def capacity_for_prefetch(self) -> int:
        """Slots a prefetch could take now: free ones plus evictable ones."""
        return len(self.free) + len(self.evictable(for_demand=False))

    def preload(self, keys: list[int]) -> None:
        """Mark ``keys`` resident in slots ``0..len(keys)-1`` (the caller filled the memory)."""
        for s, key in enumerate(keys):
            self.slot_key[s], self.state[s] = key, READY
            self.key_slot[key] = s
            self.policy.on_fill(s, key, prefetch=False)
        self.free = list(range(self.num_slots - 1, len(keys) - 1, -1))

    # ------------------------------------------------------------------ I/O side
    def allocate(self, t: Transfer) -> int | None:
        """Take a free slot or evict the cache policy's victim; None when nothing may be taken."""
        if self.free:
            s = self.free.pop()
        else:
            cands = self.evictable(for_demand=t.demand)
            if len(cands) == 0:
                return None
            s = self.policy.victim(cands)
            old = int(self.slot_key[s])
            self.policy.on_evict(s, old)
            del self.key_slot[old]
            if self.unused[s]:
                self.stats.prefetch_wasted_bytes += self.expert_nbytes
            self.prefetched[s] = self.unused[s] = False
        self.slot_key[s], self.state[s] = t.key, LOADING
        self.key_slot[t.key] = s
        if t.demand:
            self.pins[s] += 1  # the waiting compute thread holds it until it has used it
        return s

    def land(self, s: int, t: Transfer) -> None:
        """The copy into ``s`` completed."""
        self.state[s] = READY
        self.prefetched[s] = self.unused[s] = not t.demand
        if t.demand:
            self.stats.demand_bytes += self.expert_nbytes
        else:
            self.stats.prefetch_bytes += self.expert_nbytes
        self.policy.on_fill(s, t.key, prefetch=not t.demand)

    # ------------------------------------------------------------------ compute side
    def release(self, s: int) -> None:
        """The compute thread finished using the expert in ``s``."""
        self.pins[s] -= 1
        if self.unused[s]:
            self.stats.prefetch_used += 1
        self.prefetched[s] = self.unused[s] = False
        self.policy.on_use(s, int(self.slot_key[s]))

    def settle_prefetches(self, layer: int, needed: set[int]) -> None:
        """Layer ``layer`` is about to run: its prefetched experts it does not need turned out
        unused this time; they lose their protection and the policy resets their priority."""
        mask = self.prefetched & (self.state == READY) & (self.slot_key // self.num_experts == layer)
        for s in np.flatnonzero(mask).tolist():
            key = int(self.slot_key[s])
            if key not in needed:
                self.prefetched[s] = False
                self.policy.on_prefetch_unused(s, key)


def apply_prefetch_plan(
    parts: list[Partition],
    home: np.ndarray,
    plan: list[tuple[int, float]],
    replace: bool,
    stats: ExpertStats,
    now: float | None = None,
) -> None:
    """Queue prefetches ``[(flat key, priority)]`` on each expert's home partition (MoE-Infinity §5.1).

    With ``replace``, queued prefetches not in ``plan`` are cancelled (in-flight copies finish).
    Keys resident or loading are skipped; a queued transfer is re-pushed only when its priority
    changed (a queued demand is never downgraded). ``now`` stamps the transfers (simulated time).
    """
    if replace:
        wanted = {k for k, _ in plan}
        for part in parts:
            for key in part.queue.queued_prefetch_keys():
                if key not in wanted:
                    part.queue.cancel(key)
                    stats.prefetch_cancelled += 1
    for key, prio in plan:
        part = parts[home[key]]
        if key in part.key_slot:
            continue
        queued = part.queue.queued(key)
        if queued is not None and (queued.demand or queued.priority == prio):
            continue
        if queued is None:
            stats.prefetch_issued += 1
        t = Transfer(key, demand=False, priority=prio)
        if now is not None:
            t.queued_at = now
        part.queue.push(t)
