"""Runtime statistics as plain dataclasses; exporters (Prometheus, JSON) live at the edges.

A *lookup* is one (MoE layer, expert) needed by a step; a *hit* means the expert was resident or
fully prefetched when the layer needed it (MoE-Infinity's buffer hit). *Blocking seconds* are the
time the compute thread waited for expert copies (the paper's GPU blocking time).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field


def _zeros(n: int) -> list:
    return [0] * n


# the per-layer integer counters of ExpertStats
_PER_LAYER_COUNTS = (
    "lookups",
    "hits",
    "hits_prefetched",
    "late_prefetches",
    "demand_fetches",
    "expert_batches",
    "cpu_experts",
)


@dataclass
class ExpertStats:
    """Expert-buffer counters, per MoE layer (lists of length L) and per device."""

    num_layers: int
    num_devices: int = 1
    lookups: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    hits_prefetched: list[int] = field(default_factory=list)  # hit thanks to a finished prefetch
    late_prefetches: list[int] = field(default_factory=list)  # needed while its prefetch was in flight
    demand_fetches: list[int] = field(default_factory=list)
    blocking_s: list[float] = field(default_factory=list)
    device_lookups: list[int] = field(default_factory=list)
    device_hits: list[int] = field(default_factory=list)
    device_blocking_s: list[float] = field(default_factory=list)
    demand_bytes: int = 0
    prefetch_bytes: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0
    prefetch_wasted_bytes: int = 0  # prefetched, then evicted or dropped unused
    # expert batches the compute thread ran per layer: a layer run's resident experts as one batch,
    # then each group of experts that landed together (a GPU launches each batch's kernels apart;
    # on the CPU each costs the index work and ops of a grouped call). Counted by the runtime's
    # layer runs; not in :meth:`summary` (the simulator has no batches).
    expert_batches: list[int] = field(default_factory=list)
    # copies landed and their seconds as the I/O threads timed them (the copy engine's own timing:
    # CUDA copy-stream events, the memcpy, or an emulated link's time); not in :meth:`summary`
    copies: int = 0
    copy_s: float = 0.0
    # hybrid expert execution (moe_runtime.hybrid), counted by the runtime; not in :meth:`summary`:
    # misses computed on the CPU per layer (lookups, not hits, no copy), the CPU threads' seconds
    # on them, the compute thread's seconds waiting for their outputs, and the copies they avoided
    cpu_experts: list[int] = field(default_factory=list)
    cpu_expert_s: float = 0.0
    cpu_wait_s: float = 0.0
    cpu_avoided_bytes: int = 0

    def __post_init__(self) -> None:
        for name in _PER_LAYER_COUNTS:
            if not getattr(self, name):
                setattr(self, name, _zeros(self.num_layers))
        if not self.blocking_s:
            self.blocking_s = [0.0] * self.num_layers
        for name in ("device_lookups", "device_hits"):
            if not getattr(self, name):
                setattr(self, name, _zeros(self.num_devices))
        if not self.device_blocking_s:
            self.device_blocking_s = [0.0] * self.num_devices

    @property
    def total_lookups(self) -> int:
        return sum(self.lookups)

    @property
    def total_hits(self) -> int:
        return sum(self.hits)

    @property
    def hit_rate(self) -> float:
        return self.total_hits / self.total_lookups if self.total_lookups else 0.0

    @property
    def total_blocking_s(self) -> float:
        return sum(self.blocking_s)

    def snapshot(self) -> ExpertStats:
        return copy.deepcopy(self)

    def summary(self) -> dict:
        """Totals for ``--json`` output and the CLI."""
        return {
            "lookups": self.total_lookups,
            "hits": self.total_hits,
            "misses": self.total_lookups - self.total_hits,
            "hit_rate": round(self.hit_rate, 4),
            "hits_prefetched": sum(self.hits_prefetched),
            "late_prefetches": sum(self.late_prefetches),
            "demand_fetches": sum(self.demand_fetches),
            "blocking_s": round(self.total_blocking_s, 6),
            "demand_bytes": self.demand_bytes,
            "prefetch_bytes": self.prefetch_bytes,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_cancelled": self.prefetch_cancelled,
            "prefetch_wasted_bytes": self.prefetch_wasted_bytes,
        }

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineStats:
    """Cumulative engine counters (read by the Prometheus exporter and benchmarks).

    ``prompt_tokens`` counts each request's prompt positions once, computed or served from the
    prefix cache (not again when a preempted request recomputes them). The paged KV cache's
    (``moe_runtime.engine.kv_manager``): ``preemptions`` (sequences preempted by recompute),
    ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens looked up in the prefix cache
    at admission / found there), ``kv_blocks_used`` (blocks held now, a gauge) of
    ``kv_blocks_total``.
    """

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    step_seconds: float = 0.0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count
    # paged KV cache
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
