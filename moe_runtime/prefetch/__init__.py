"""Prefetch policies: after each MoE layer's routing, decide which experts of later layers to load.

Registry of every policy behind one interface (:class:`PrefetchPolicy`), so each comparison is one
flag: ``on-demand``, ``next-layer-all``, ``model-counts``, ``hot-experts``, ``eam``, ``oracle``.
"""

from __future__ import annotations

from typing import Any

from moe_runtime.errors import ConfigError
from moe_runtime.prefetch.base import PrefetchPolicy
from moe_runtime.prefetch.baselines import HotExpertsPrefetch, ModelCountsPrefetch, NextLayerAllPrefetch
from moe_runtime.prefetch.eam import EAMPrefetch
from moe_runtime.prefetch.oracle import OraclePrefetch, OracleSchedule

PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    cls.name: cls
    for cls in (
        PrefetchPolicy,
        NextLayerAllPrefetch,
        ModelCountsPrefetch,
        HotExpertsPrefetch,
        EAMPrefetch,
        OraclePrefetch,
    )
}

__all__ = ["PREFETCH_POLICIES", "OracleSchedule", "PrefetchPolicy", "make_prefetch_policy"]


def make_prefetch_policy(name: str, **kwargs: Any) -> PrefetchPolicy:
    """Build a registered policy.

    Raises:
        ConfigError: unknown name, or a policy missing what it needs (EAMC, access log).
    """
    if name not in PREFETCH_POLICIES:
        raise ConfigError(
            f"--prefetch-policy {name!r} is unknown (choose from {', '.join(PREFETCH_POLICIES)})"
        )
    return PREFETCH_POLICIES[name](**kwargs)
