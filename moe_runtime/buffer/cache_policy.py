"""Cache policies: which resident expert a slot is taken from when the buffer is full.

A policy keeps a priority per slot (lower is evicted first). The buffer calls its hooks under the
buffer lock and asks :meth:`CachePolicy.victim` to choose among the slots it may evict (never a
slot being loaded, pinned by the running layer or, for prefetches, holding an unused prefetch).
New policies subclass :class:`CachePolicy` and register in :data:`CACHE_POLICIES`.

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


class LRUPolicy(CachePolicy):
    """Least recently used (Mixtral-Offloading's and llama.cpp's expert cache)."""

    name = "lru"

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        self.priority[slot] = self.tick()

    def on_use(self, slot: int, key: int) -> None:
        self.priority[slot] = self.tick()

    def on_prefetch_unused(self, slot: int, key: int) -> None:
        self.priority[slot] = self.tick()


CACHE_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy}


def _register_builtin() -> None:
    from moe_runtime.buffer.policies import (
        EAMCachePolicy,
        EAMReuseCachePolicy,
        ModelCountsCachePolicy,
        OracleCachePolicy,
    )

    for cls in (EAMCachePolicy, EAMReuseCachePolicy, ModelCountsCachePolicy, OracleCachePolicy):
        CACHE_POLICIES[cls.name] = cls


def make_cache_policy(name: str, num_slots: int, num_experts: int, **context) -> CachePolicy:
    """Build a registered policy; ``context`` (``num_layers``, ``recorder``, ``oracle``...) reaches
    policies whose constructors take it."""
    from moe_runtime.errors import ConfigError

    if len(CACHE_POLICIES) == 1:
        _register_builtin()
    if name not in CACHE_POLICIES:
        raise ConfigError(f"--cache-policy {name!r} is unknown (choose from {', '.join(CACHE_POLICIES)})")
    cls = CACHE_POLICIES[name]
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return cls(num_slots, num_experts, **{k: v for k, v in context.items() if k in accepted})
