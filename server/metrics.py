"""Prometheus exporter: request histograms observed by the server, counters read from the runtime.

NOTE: two sources. Latency histograms (TTFT, TPOT, e2e) are observed by the server when a request
finishes. Everything cumulative is *not* counted twice at the edge: a custom collector reads the
runtime's own statistics at scrape time (``EngineStats`` as published by the engine thread after
each step, ``ExpertStats`` under ``buffer.cond`` for a consistent snapshot), so ``/metrics`` always
equals the runtime's figures.

Labelling of the expert counters ``expert_lookups_total``, ``expert_hits_total`` and
``expert_blocking_seconds_total``: the runtime keeps them per MoE layer and per device, not per
(layer, device), so each is exported as two families of series in one metric:

* per layer: ``{layer="<i>", device="all"}`` for MoE layer ``i`` (0-based among MoE layers);
* per device: ``{layer="all", device="<d>"}`` for device partition ``d``.

Select one family before summing (``sum(x{device="all"})`` or ``sum(x{layer="all"})``): summing
both counts everything twice. Ratios such as the buffer hit rate
``sum(rate(hits)) / sum(rate(lookups))`` are the same over either family or both.

All names carry the ``moeserve_`` prefix (DESIGN.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moe_runtime.engine.request import RequestOutput

PREFIX = "moeserve_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class TraceSource(Protocol):
    """What the exporter reads from the tracer hooks (all may be None when tracing is off)."""

    def eamc_entries(self) -> int | None: ...

    def eamc_query_seconds(self) -> tuple[int, float] | None: ...


class RuntimeCollector(Collector):
    """Builds the counter and gauge families from the runtime's cumulative stats at scrape time.

    Args:
        client: the :class:`~server.engine_client.EngineClient` (snapshot and queue lengths).
        trace: tracer hooks for the EAMC figures, or None.
    """

    def __init__(self, client: Any, trace: TraceSource | None = None) -> None:
        self.client, self.trace = client, trace

    def describe(self) -> list[Metric]:
        return []  # built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snap = self.client.snapshot
        yield _gauge(
            "engine_up",
            "1 while the engine thread runs, 0 once it died (/health is 503).",
            1 if self.client.alive else 0,
        )
        yield _gauge("requests_running", "Requests in the running batch.", snap.num_running)
        yield _gauge("requests_waiting", "Requests waiting for a batch slot.", self.client.num_waiting)
        yield _counter("prompt_tokens", "Prompt tokens prefilled.", snap.stats.prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated.", snap.stats.generation_tokens)
        success = CounterMetricFamily(
            PREFIX + "request_success", "Finished requests by finish reason.", labels=["finished_reason"]
        )
        for reason in sorted(set(snap.stats.requests_finished) | {"stop", "length", "abort"}):
            success.add_metric([reason], snap.stats.requests_finished.get(reason, 0))
        yield success
        yield from self._expert_metrics()
        yield from self._eamc_metrics()

    def _expert_metrics(self) -> Iterator[Metric]:
        buffer = self.client.engine.buffer
        with buffer.cond:
            st = buffer.stats.snapshot()
        per = [
            ("expert_lookups", "Expert lookups (one per MoE layer and expert a step needs).", "lookups"),
            ("expert_hits", "Expert lookups found resident or fully prefetched.", "hits"),
            ("expert_blocking_seconds", "Seconds compute waited for expert copies.", "blocking_s"),
        ]
        for name, doc, attr in per:
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["layer", "device"])
            for layer, value in enumerate(getattr(st, attr)):
                fam.add_metric([str(layer), "all"], value)
            for dev, value in enumerate(getattr(st, "device_" + attr)):
                fam.add_metric(["all", str(dev)], value)
            yield fam
        transfer = CounterMetricFamily(
            PREFIX + "expert_transfer_bytes", "Bytes copied host->device by kind.", labels=["kind"]
        )
        transfer.add_metric(["prefetch"], st.prefetch_bytes)
        transfer.add_metric(["demand"], st.demand_bytes)
        yield transfer
        yield _counter("prefetch_issued", "Prefetches queued.", st.prefetch_issued)
        yield _counter("prefetch_used", "Prefetched experts used before eviction.", st.prefetch_used)
        yield _counter("prefetch_cancelled", "Queued prefetches cancelled.", st.prefetch_cancelled)

    def _eamc_metrics(self) -> Iterator[Metric]:
        if self.trace is None:
            return
        entries = self.trace.eamc_entries()
        if entries is not None:
            yield _gauge("eamc_entries", "EAMs held in the EAM collection.", entries)
        query = self.trace.eamc_query_seconds()
        if query is not None:
            count, total = query
            fam = CounterMetricFamily(PREFIX + "eamc_query_seconds", "Seconds spent in EAMC queries.")
            fam.add_metric([], total)
            yield fam
            yield _counter("eamc_queries", "EAMC queries (batched, one per MoE layer).", count)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """One app's registry: the runtime collector plus the request latency histograms.

    Args:
        client: the engine client the collector reads.
        trace: tracer hooks for the EAMC metrics, or None.
    """

    def __init__(self, client: Any, trace: TraceSource | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(client, trace))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first generated token (s).",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean gap between output tokens after the first, per request (s).",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish (s).",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )

    def observe(self, out: RequestOutput) -> None:
        """Record one finished request's latencies (``time.monotonic`` stamps from the engine)."""
        if out.finish_time is None:
            return
        self.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
        if out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            if out.num_output_tokens > 1:
                gap = (out.finish_time - out.first_token_time) / (out.num_output_tokens - 1)
                self.tpot.observe(max(0.0, gap))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
