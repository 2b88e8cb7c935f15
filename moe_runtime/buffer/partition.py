"""One device's share of the expert buffer: its slots, residency tables, queue and I/O thread state.

All fields are guarded by the owning :class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer`'s lock.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_runtime.buffer.cache_policy import CachePolicy
from moe_runtime.io.copy_engine import CopyEngine
from moe_runtime.io.link import LinkModel
from moe_runtime.io.transfer_queue import TransferQueue

FREE, LOADING, READY = 0, 1, 2


class Partition:
    """Slots of one device.

    Attributes:
        slots: ``[S, 3 * I * H]`` device tensor (or, when every expert fits on a single CPU device
            without link emulation, the host store itself: nothing is copied).
        slot_key: ``[S]`` flat expert key held by each slot, -1 when free.
        state: ``[S]`` FREE / LOADING / READY.
        pins: ``[S]`` users that must see the slot unchanged (the running layer's compute).
        prefetched: ``[S]`` landed by a prefetch and not used yet (protected from prefetches).
        key_slot: flat key -> slot for LOADING and READY slots (the residency map).
    """

    def __init__(
        self,
        index: int,
        device: torch.device,
        slots: torch.Tensor,
        hidden: int,
        intermediate: int,
        policy: CachePolicy,
        link: LinkModel | None,
    ) -> None:
        self.index = index
        self.device = device
        self.slots = slots
        n = slots.shape[0]
        gu = 2 * intermediate * hidden
        self.gate_up = [slots[s, :gu].view(2 * intermediate, hidden) for s in range(n)]
        self.down = [slots[s, gu:].view(hidden, intermediate) for s in range(n)]
        self.slot_key = np.full(n, -1, dtype=np.int64)
        self.state = np.zeros(n, dtype=np.int8)
        self.pins = np.zeros(n, dtype=np.int32)
        self.prefetched = np.zeros(n, dtype=bool)
        self.release_events: list[torch.cuda.Event | None] = [None] * n
        self.key_slot: dict[int, int] = {}
        self.free: list[int] = list(range(n - 1, -1, -1))
        self.queue = TransferQueue()
        self.policy = policy
        self.link = link
        self.copier = CopyEngine(device)

    @property
    def num_slots(self) -> int:
        return len(self.slot_key)

    def evictable(self, for_demand: bool) -> np.ndarray:
        """Slots that may be taken: ready, unpinned and (for prefetches) not an unused prefetch."""
        mask = (self.state == READY) & (self.pins == 0)
        if not for_demand:
            mask &= ~self.prefetched
        return np.flatnonzero(mask)
