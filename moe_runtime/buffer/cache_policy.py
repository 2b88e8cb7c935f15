"""Cache policies by name: LRU, the registry of every built-in policy and :func:`make_cache_policy`.

The interface a policy implements is :class:`~moe_runtime.buffer.cache_base.CachePolicy`; the
policies beyond LRU (``eam``, ``eam-reuse``, ``model-counts``, ``oracle``) live in
:mod:`moe_runtime.buffer.policies`.
"""

from __future__ import annotations

import inspect

from moe_runtime.buffer.cache_base import CachePolicy
from moe_runtime.buffer.policies import (
    EAMCachePolicy,
    EAMReuseCachePolicy,
    ModelCountsCachePolicy,
    OracleCachePolicy,
)
from moe_runtime.errors import ConfigError


class LRUPolicy(CachePolicy):
    """Least recently used (Mixtral-Offloading's and llama.cpp's expert cache)."""

    name = "lru"

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        self.priority[slot] = self.tick()

    def on_use(self, slot: int, key: int) -> None:
        self.priority[slot] = self.tick()

    def on_prefetch_unused(self, slot: int, key: int) -> None:
        self.priority[slot] = self.tick()


#: Cache policies by name, in the order of :data:`moe_runtime.config.CACHE_POLICY_NAMES`.
CACHE_POLICIES: dict[str, type[CachePolicy]] = {
    cls.name: cls
    for cls in (LRUPolicy, EAMCachePolicy, EAMReuseCachePolicy, ModelCountsCachePolicy, OracleCachePolicy)
}


def make_cache_policy(name: str, num_slots: int, num_experts: int, **context) -> CachePolicy:
    """Build a registered policy; ``context`` (``num_layers``, ``recorder``, ``oracle``...) reaches
    policies whose constructors take it."""
    if name not in CACHE_POLICIES:
        raise ConfigError(f"--cache-policy {name!r} is unknown (choose from {', '.join(CACHE_POLICIES)})")
    cls = CACHE_POLICIES[name]
    accepted = inspect.signature(cls.__init__).parameters
    return cls(num_slots, num_experts, **{k: v for k, v in context.items() if k in accepted})
