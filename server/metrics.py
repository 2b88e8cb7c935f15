"""Prometheus exporter: request histograms observed by the server, counters read from the runtime.

NOTE: two sources. Latency histograms (TTFT, TPOT, e2e) are observed by the server when a request
finishes. Everything cumulative is *not* counted twice at the edge: a custom collector reads the
runtime's own statistics at scrape time (``EngineStats`` as published by the engine thread after
each step, ``ExpertStats`` under ``buffer.cond`` for a consistent snapshot), so ``/metrics`` always
equals the runtime's figures.

Expert counters: the runtime keeps expert lookups, hits and blocking seconds per MoE layer and
per device, not per (layer, device), so each is exported as two metric families with one
aggregation level each, and ``sum()`` over either is the total:

* per layer: ``expert_lookups_total{layer="<i>"}``, ``expert_hits_total{layer}``,
  ``expert_blocking_seconds_total{layer}`` for MoE layer ``i`` (0-based among MoE layers);
* per device: ``device_expert_lookups_total{device="<d>"}``, ``device_expert_hits_total{device}``,
  ``device_expert_blocking_seconds_total{device}`` for device partition ``d``.

HTTP-edge counters (``http_responses_total{route,status}``, ``requests_rejected_total{reason}``,
``connection_timeouts_total{phase}``, ``accept_errors_total``) are counted by the server itself:
:class:`HTTPMetricsMiddleware` sees every response the app sends, the connection protocol and the
accept-error handler report the others (``server/runner.py``).

All names carry the ``moeserve_`` prefix; docs/server.md lists them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Router, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_runtime.engine.request import RequestOutput

PREFIX = "moeserve_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class TraceSource(Protocol):
    """What the exporter reads from the tracer hooks (all may be None when tracing is off)."""

    def eamc_entries(self) -> int | None: ...

    def eamc_query_seconds(self) -> tuple[int, float] | None: ...

    def eamc_saves(self) -> tuple[int, int] | None: ...


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
        yield _counter(
            "prompt_tokens",
            "Prompt tokens prefilled or served from the prefix cache (a recompute after preemption "
            "is not counted again).",
            snap.stats.prompt_tokens,
        )
        yield _counter("generation_tokens", "Tokens generated.", snap.stats.generation_tokens)
        success = CounterMetricFamily(
            PREFIX + "request_success", "Finished requests by finish reason.", labels=["finished_reason"]
        )
        for reason in sorted(set(snap.stats.requests_finished) | {"stop", "length", "abort"}):
            success.add_metric([reason], snap.stats.requests_finished.get(reason, 0))
        yield success
        yield from self._kv_metrics(snap.stats)
        yield from self._expert_metrics()
        yield from self._eamc_term_metrics()
        yield from self._eamc_metrics()

    @staticmethod
    def _kv_metrics(stats: Any) -> Iterator[Metric]:
        """The paged KV cache's figures (``EngineStats``; docs/kv-cache.md)."""
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache when their request was admitted.",
            stats.prefix_cache_queries,
        )
        yield _counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV blocks reused, not computed).",
            stats.prefix_cache_hits,
        )
        yield _counter(
            "preemptions",
            "Running requests preempted when KV-cache blocks ran out (recomputed when readmitted).",
            stats.preemptions,
        )
        total = stats.kv_blocks_total
        yield _gauge(
            "kv_cache_usage",
            "Share of KV-cache blocks held by requests (0..1; cached free blocks count as free).",
            stats.kv_blocks_used / total if total else 0.0,
        )

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
            for prefix, label, values in (
                ("", "layer", getattr(st, attr)),
                ("device_", "device", getattr(st, "device_" + attr)),
            ):
                fam = CounterMetricFamily(PREFIX + prefix + name, f"{doc} Per {label}.", labels=[label])
                for index, value in enumerate(values):
                    fam.add_metric([str(index)], value)
                yield fam
        batches = CounterMetricFamily(
            PREFIX + "expert_batches",
            "Expert batches the compute thread ran: per layer run the resident experts as one, then "
            "each group of experts that landed together (each launches its own kernels). Per layer.",
            labels=["layer"],
        )
        for index, value in enumerate(st.expert_batches):
            batches.add_metric([str(index)], value)
        yield batches
        transfer = CounterMetricFamily(
            PREFIX + "expert_transfer_bytes", "Bytes copied host->device by kind.", labels=["kind"]
        )
        transfer.add_metric(["prefetch"], st.prefetch_bytes)
        transfer.add_metric(["demand"], st.demand_bytes)
        yield transfer
        yield _counter("expert_copies", "Expert copies landed (timed: expert_copy_seconds).", st.copies)
        copy_s = CounterMetricFamily(
            PREFIX + "expert_copy_seconds",
            "Seconds of the landed expert copies by the I/O threads' own timing (CUDA copy-stream "
            "events, the memcpy, or an emulated link's time): rate(bytes) / rate(this) is the link's "
            "measured bandwidth.",
        )
        copy_s.add_metric([], st.copy_s)
        yield copy_s
        yield from _hybrid_metrics(st)
        yield _counter("prefetch_issued", "Prefetches queued.", st.prefetch_issued)
        yield _counter("prefetch_used", "Prefetched experts used before eviction.", st.prefetch_used)
        yield _counter("prefetch_cancelled", "Queued prefetches cancelled.", st.prefetch_cancelled)

    def _eamc_term_metrics(self) -> Iterator[Metric]:
        """The ``eam`` policy's weighing of its EAMC term (``moe_runtime.prefetch.term_value``),
        when the runtime weighs it: plans with and without the term, its measured gain and
        host time. Counters the engine thread bumps; read without its lock (single ints and
        floats, a scrape may see one plan's update half-way between two of them)."""
        term = getattr(getattr(self.client.engine, "prefetcher", None), "eamc_term", None)
        if term is None:
            return
        plans = CounterMetricFamily(
            PREFIX + "eamc_term_plans",
            "Prefetch plans that computed the EAMC term (computed=true) or left it out while its "
            "measured gain did not beat its host time (computed=false).",
            labels=["computed"],
        )
        plans.add_metric(["true"], term.used)
        plans.add_metric(["false"], term.skipped)
        yield plans
        yield _gauge(
            "eamc_term_gain_candidates",
            "Running mean of the extra next-layer candidates used per plan with the EAMC term.",
            term.gain_hits,
        )
        yield _gauge(
            "eamc_term_host_seconds", "Running mean host seconds of the EAMC term per plan.", term.host_s
        )

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
        saves = self.trace.eamc_saves()
        if saves is not None:
            ok, failed = saves
            yield _counter("eamc_saves", "EAMC files written.", ok)
            yield _counter("eamc_save_failures", "EAMC saves that failed (the file was not written).", failed)


def _hybrid_metrics(st: Any) -> Iterator[Metric]:
    """Hybrid expert execution (``moe_runtime.hybrid``; 0 with ``--expert-compute device``): misses
    computed on the CPU per layer, the CPU threads' seconds on them, the compute thread's wait for
    their outputs and the copy bytes they avoided."""
    cpu = CounterMetricFamily(
        PREFIX + "expert_cpu_runs",
        "Missed experts computed on the CPU from host memory, not copied (hybrid execution). Per layer.",
        labels=["layer"],
    )
    for index, value in enumerate(st.cpu_experts):
        cpu.add_metric([str(index)], value)
    yield cpu
    yield _counter(
        "expert_cpu_seconds", "Seconds the CPU expert threads spent computing experts.", st.cpu_expert_s
    )
    yield _counter(
        "expert_cpu_wait_seconds", "Seconds compute waited for experts computed on the CPU.", st.cpu_wait_s
    )
    yield _counter(
        "expert_transfer_avoided_bytes",
        "Bytes not copied host->device because the expert was computed on the CPU.",
        st.cpu_avoided_bytes,
    )


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

        self.http_responses = Counter(
            PREFIX + "http_responses",
            "HTTP responses sent by the app, by route (path, or 'other') and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests answered with an error other than 500, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(reason)  # every reason present from the start, at 0
        self.connection_timeouts = Counter(
            PREFIX + "connection_timeouts",
            "Connections closed because the request head or body did not arrive in time.",
            ["phase"],
            registry=self.registry,
        )
        for phase in ("header", "body"):
            self.connection_timeouts.labels(phase)
        self.accept_errors = Counter(
            PREFIX + "accept_errors",
            "Failed accept() calls (out of file descriptors or memory).",
            registry=self.registry,
        )

    def connection_timeout(self, phase: str) -> None:
        """A connection was closed by the ``phase`` ("header" or "body") deadline."""
        self.connection_timeouts.labels(phase).inc()

    def accept_error(self) -> None:
        self.accept_errors.inc()

    def response(self, route: str, status: int, error_code: str | None) -> None:
        """Count one HTTP response; an error other than 500 is also a rejection."""
        self.http_responses.labels(route, str(status)).inc()
        reason = reject_reason(status, error_code)
        if reason is not None:
            self.requests_rejected.labels(reason).inc()

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


# error code of the OpenAI error object -> rejection reason; the statuses fill in the rest
REJECT_REASONS = (
    "invalid_request",
    "unauthorized",
    "too_large",
    "queue_full",
    "shutting_down",
    "engine_dead",
)
_REASON_BY_CODE = {
    "invalid_api_key": "unauthorized",
    "request_too_large": "too_large",
    "queue_full": "queue_full",
    "shutting_down": "shutting_down",
    "engine_dead": "engine_dead",
}
_REASON_BY_STATUS = {401: "unauthorized", 413: "too_large", 429: "queue_full", 503: "shutting_down"}


def reject_reason(status: int, error_code: str | None) -> str | None:
    """The ``requests_rejected_total`` reason of a response, or None when it is no rejection.

    2xx/3xx, 500 (a bug, counted only by status) and 499 (the client left) are not rejections;
    other 4xx are ``invalid_request`` unless the status or error code says more.
    """
    if status < 400 or status in (499, 500):
        return None
    if error_code in _REASON_BY_CODE:
        return _REASON_BY_CODE[error_code]
    return _REASON_BY_STATUS.get(status, "invalid_request" if status < 500 else None)


def _path_templates(routes: list[Any], prefix: str = "") -> Iterator[tuple[Any, str]]:
    """``(compiled path regex, path template)`` of every route, included routers flattened."""
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's included router
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from _path_templates(inner.routes, prefix + getattr(context, "prefix", ""))
        elif hasattr(route, "path") and hasattr(route, "path_regex"):
            if prefix:
                yield compile_path(prefix + route.path)[0], prefix + route.path
            else:
                yield route.path_regex, route.path


class HTTPMetricsMiddleware:
    """Counts every response the app sends in :class:`ServerMetrics` (route, status, reason).

    ``route`` is the matched route's path template, or ``other`` when no route of ``router``
    matches (bounded label values whatever paths clients send). A response sent before routing
    (401 from the API-key check, 413) is labelled by matching the path against ``router``. The
    reason of an error comes from the ``code`` of the OpenAI error object in the body. An
    exception escaping the app before a response started counts as a 500.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, router: Router) -> None:
        self.app, self.metrics, self.router = app, metrics, router
        self._templates: list[tuple[Any, str]] | None = None  # (path regex, template), built lazily

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is not None:
            return getattr(route, "path", "other")
        if self._templates is None:  # routes are all included by the first request
            self._templates = list(_path_templates(self.router.routes))
        path = scope.get("path", "")
        for regex, template in self._templates:  # not routed yet (401, 413): match the templates
            if regex.match(path):
                return template
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal status, counted
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if status < 400:
                    counted = True
                    self.metrics.response(self._route(scope), status, None)
            elif message["type"] == "http.response.body" and not counted and status is not None:
                counted = True
                self.metrics.response(self._route(scope), status, _error_code(message.get("body", b"")))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            if not counted:
                counted = True
                self.metrics.response(self._route(scope), status or 500, None)
            raise
        if not counted and status is not None:
            self.metrics.response(self._route(scope), status, None)


def _error_code(body: bytes) -> str | None:
    """``error.code`` of an OpenAI error object, or None."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None
