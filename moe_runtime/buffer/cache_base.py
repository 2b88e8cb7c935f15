"""The cache-policy interface: which resident expert a slot is taken from when the buffer is full.

A policy keeps a priority per slot (lower is evicted first). The buffer calls its hooks under the
buffer lock and asks :meth:`CachePolicy.victim` to choose among the slots it may evict (never a
slot being loaded, pinned by the running layer or, for prefetches, holding an unused prefetch).
New policies subclass :class:`CachePolicy`, register in
:data:`moe_runtime.buffer.cache_policy.CACHE_POLICIES` and are named in
:data:`moe_runtime.config.CACHE_POLICY_NAMES` (the settings check names against it).

A policy with ``ordered = True`` promises that its victim is the candidate with the lowest
``priority`` (ties: the lowest slot) and that priorities change only inside the slot hooks
(``on_fill``, ``on_use``, ``on_evict``, ``on_prefetch_unused``); the partition then keeps its
evictable slots in a heap and never calls :meth:`CachePolicy.victim`. A policy whose choice moves
with state outside those hooks (``after_routing`` counts, an oracle's cursor) sets it False. A
policy may change ``ordered`` while in use (``eam-reuse`` is LRU while the ``eam`` prefetch runs
lean): it then calls :attr:`CachePolicy.on_order_change`, which the partition sets, under the
buffer lock.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class CachePolicy:
    """Base class; subclasses update ``self.priority`` (``[num_slots]`` list of float)."""

    name = "base"
    ordered = True  # see the module note

    def __init__(self, num_slots: int, num_experts: int) -> None:
        self.priority: list[float] = [0.0] * num_slots
        self.num_experts = num_experts
        self._tick = 0.0
        # called (no arguments) when ``ordered`` changes; set by the partition that owns the policy
        self.on_order_change: Callable[[], None] | None = None

    def tick(self) -> float:
        self._tick += 1.0
        return self._tick

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        """An expert landed in ``slot`` (by demand or prefetch)."""

    def on_use(self, slot: int, key: int) -> None:
        """The compute thread finished using the expert in ``slot``."""

    def on_evict(self, slot: int, key: int) -> None:
        """The expert in ``slot`` is being evicted."""

    def on_prefetch_unused(self, slot: int, key: int) -> None:
        """A prefetched expert's layer ran without it (a mis-prefetch); it is unprotected now."""

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """MoE layer ``layer`` routed its tokens (``topk_ids [T, k]`` on the host)."""

    def victim(self, candidates: np.ndarray) -> int:
        """Slot to evict among ``candidates`` (non-empty, ascending slot ids): the lowest priority,
        the first (lowest slot) among equal ones."""
        prio = self.priority
        return int(min(np.asarray(candidates).tolist(), key=lambda s: (prio[s], s)))
