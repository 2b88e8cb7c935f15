"""Scrape the server's Prometheus ``/metrics`` before and after a run and take the difference.

Counter names are those of the server's ``/metrics`` (``docs/server.md``, "Metrics"; prefix
``moeserve_``). Buffer hit rate over a run is
``Δ moeserve_expert_hits_total / Δ moeserve_expert_lookups_total``; blocking time is
``Δ moeserve_expert_blocking_seconds_total``.

Each metric family has one aggregation level (``expert_lookups_total{layer}``; the per-device
figures are the separate ``device_expert_*`` families, ``server/metrics.py``), so a total is the sum
of a family's series.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "moeserve_"
LOOKUPS = PREFIX + "expert_lookups_total"
HITS = PREFIX + "expert_hits_total"
BLOCKING = PREFIX + "expert_blocking_seconds_total"
SUCCESS = PREFIX + "request_success_total"
GEN_TOKENS = PREFIX + "generation_tokens_total"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
TRANSFER = PREFIX + "expert_transfer_bytes_total"

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(slots=True)
class MetricsSnapshot:
    """All samples of one scrape: ``(sample name, sorted label pairs) -> value``."""

    samples: dict[SampleKey, float] = field(default_factory=dict)

    def total(self, name: str) -> float | None:
        """Sum of a sample name over all its series; ``None`` when the server has no such sample."""
        series = [v for (n, _), v in self.samples.items() if n == name]
        return sum(series) if series else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Values of a sample name summed per value of one label."""
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            key = dict(labels).get(label, "")
            if n == name:
                out[key] = out.get(key, 0.0) + v
        return out


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text exposition format.

    Raises:
        ValueError: the text is not valid exposition format.
    """
    snap = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            snap.samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return snap


@dataclass(slots=True)
class ServerDelta:
    """Server counters accumulated during a run (after minus before). ``None`` = not exported.

    Attributes:
        expert_lookups, expert_hits: expert buffer lookups and hits (all layers and devices).
        hit_rate: ``expert_hits / expert_lookups`` (``None`` when there were no lookups).
        blocking_s: time the compute thread waited for expert copies, seconds.
        success_by_reason: finished requests per ``finished_reason`` (``abort`` included).
        requests_success: sum of ``success_by_reason`` except ``abort``.
        generation_tokens, prompt_tokens: tokens counted by the server.
        transfer_bytes: expert bytes copied host -> device, per ``kind`` (prefetch / demand).
        hits_by_layer: per-layer hit rate over the run.
    """

    expert_lookups: float | None = None
    expert_hits: float | None = None
    hit_rate: float | None = None
    blocking_s: float | None = None
    success_by_reason: dict[str, float] = field(default_factory=dict)
    requests_success: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    transfer_bytes: dict[str, float] = field(default_factory=dict)
    hits_by_layer: dict[str, float] = field(default_factory=dict)


def _d(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> float | None:
    a = after.total(name)
    return None if a is None else a - (before.total(name) or 0.0)


def _d_label(before: MetricsSnapshot, after: MetricsSnapshot, name: str, label: str) -> dict[str, float]:
    b = before.by_label(name, label)
    return {k: v - b.get(k, 0.0) for k, v in sorted(after.by_label(name, label).items())}


def diff(before: MetricsSnapshot, after: MetricsSnapshot) -> ServerDelta:
    """What the server counted between two scrapes."""
    d = ServerDelta(
        expert_lookups=_d(before, after, LOOKUPS),
        expert_hits=_d(before, after, HITS),
        blocking_s=_d(before, after, BLOCKING),
        generation_tokens=_d(before, after, GEN_TOKENS),
        prompt_tokens=_d(before, after, PROMPT_TOKENS),
        success_by_reason=_d_label(before, after, SUCCESS, "finished_reason"),
        transfer_bytes=_d_label(before, after, TRANSFER, "kind"),
    )
    if d.success_by_reason:
        d.requests_success = sum(v for k, v in d.success_by_reason.items() if k != "abort")
    if d.expert_lookups and d.expert_hits is not None:
        d.hit_rate = d.expert_hits / d.expert_lookups
    lookups = _d_label(before, after, LOOKUPS, "layer")
    hits = _d_label(before, after, HITS, "layer")
    d.hits_by_layer = {k: hits.get(k, 0.0) / v for k, v in lookups.items() if v > 0}
    return d
