"""Summary statistics of a run and their tables (rich), as in vLLM's ``bench serve``.

Latencies are reported in milliseconds: p50/p90/p99 and mean of TTFT, TPOT, ITL and e2e over
successful requests (ITL over all their inter-chunk gaps). Throughput divides by the run's wall
time, from the first send to the last answer. Goodput counts successful requests whose TPOT is
within ``slo_tpot_ms`` (a request with one output token has no TPOT and counts as within).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from rich.console import Console

from clients.http import RequestRecord
from clients.metrics_scrape import ServerDelta
from clients.trace import offered_rate
from richconsole import Table

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class LatencyStats:
    """Distribution of one latency over a run, milliseconds (``None`` without samples)."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


def latency_stats(values_s: list[float]) -> LatencyStats:
    """Mean and p50/p90/p99 of latencies given in seconds, reported in milliseconds."""
    if not values_s:
        return LatencyStats(0, None, None, None, None)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
    return LatencyStats(len(ms), float(ms.mean()), p50, p90, p99)


@dataclass(slots=True)
class Summary:
    """One run, summarised.

    Attributes:
        settings: the run's settings (URL, trace, rate, seed, ...), printed beside the figures.
        requests, succeeded, failed: request counts.
        errors: failed requests per ``status`` (with HTTP code, e.g. ``http_error 503``).
        duration_s: wall time from the first send to the last answer, seconds.
        offered_rps: the rate the schedule offered, ``(requests - 1) / span`` of their scheduled
            send times, requests/s (``None`` for fewer than two requests).
        sent_rps: the same over the actual send times.
        throughput_rps, output_tokens_per_s: successful requests and their output tokens per second.
        prompt_tokens, output_tokens: summed over successful requests (from the server's usage).
        goodput_rps: successful requests within the TPOT SLO per second (``None`` without an SLO).
        slo_tpot_ms: the SLO used for goodput.
        max_send_lag_ms: largest delay of an actual send behind its schedule, milliseconds.
        ttft, tpot, itl, e2e: latency distributions.
        server: server counter deltas over the run (``None`` when ``/metrics`` was unavailable).
        client_expert_stats: ``usage.expert_stats`` summed over successful requests.
        target_rps: the average rate asked for (``--rps``, or the trace's rate times
            ``--speedup``), requests/s.
        rate_note: why the offered rate differs from the target by more than 10%, one line
            (``offered X req/s against --rps R: ...``; :func:`clients.trace.rate_note`); ``None``
            when they agree.
    """

    settings: dict[str, Any]
    requests: int
    succeeded: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    offered_rps: float | None
    throughput_rps: float
    output_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    goodput_rps: float | None
    slo_tpot_ms: float | None
    max_send_lag_ms: float | None
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    server: ServerDelta | None = None
    client_expert_stats: dict[str, float] = field(default_factory=dict)
    sent_rps: float | None = None
    target_rps: float | None = None
    rate_note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def error_key(rec: RequestRecord) -> str:
    """How a failed request is grouped: its status, plus the HTTP code when there was one."""
    return rec.status if rec.http_status is None else f"{rec.status} {rec.http_status}"


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    settings: dict[str, Any],
    slo_tpot_ms: float | None = None,
    server: ServerDelta | None = None,
) -> Summary:
    """Aggregate per-request records of one run (see the module docstring for definitions)."""
    ok = [r for r in records if r.ok]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    goodput = None
    if slo_tpot_ms is not None:
        good = sum(1 for r in ok if r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)
        goodput = good / dur
    expert: Counter[str] = Counter()
    for r in ok:
        for k, v in (r.expert_stats or {}).items():
            if isinstance(v, (int, float)):
                expert[k] += v
    return Summary(
        settings=settings,
        requests=len(records),
        succeeded=len(ok),
        failed=len(records) - len(ok),
        errors=dict(sorted(Counter(error_key(r) for r in records if not r.ok).items())),
        duration_s=duration_s,
        offered_rps=offered_rate([r.scheduled_s for r in records]),
        throughput_rps=len(ok) / dur,
        output_tokens_per_s=out_tokens / dur,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        output_tokens=out_tokens,
        goodput_rps=goodput,
        slo_tpot_ms=slo_tpot_ms,
        max_send_lag_ms=max(lags) * 1e3 if lags else None,
        ttft=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=latency_stats([g for r in ok for g in r.itl_s]),
        e2e=latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        server=server,
        client_expert_stats=dict(expert),
        sent_rps=offered_rate([r.sent_s for r in records if r.sent_s is not None]),
    )


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def render(summary: Summary, console: Console) -> None:
    """Print the settings, the latency table, throughput/goodput, errors and server counters."""
    s = summary
    console.print("[bold]Settings[/bold]: " + ", ".join(f"{k}={v}" for k, v in s.settings.items()))
    lat = Table(title="Latency (ms)", title_justify="left")
    for col in ("metric", "n", "mean", "p50", "p90", "p99"):
        lat.add_column(col, justify="left" if col == "metric" else "right")
    for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("e2e", s.e2e)):
        lat.add_row(name, str(st.count), _f(st.mean_ms), _f(st.p50_ms), _f(st.p90_ms), _f(st.p99_ms))
    console.print(lat)
    run = Table(title="Run", title_justify="left", show_header=False)
    run.add_column("what")
    run.add_column("value", justify="right")
    run.add_row("requests (ok / failed)", f"{s.requests} ({s.succeeded} / {s.failed})")
    run.add_row("wall time (s)", _f(s.duration_s))
    if s.target_rps is not None:
        run.add_row("target rate (req/s)", _f(s.target_rps, "{:.3f}"))
    run.add_row("offered rate (req/s)", _f(s.offered_rps, "{:.3f}"))
    run.add_row("sent rate (req/s)", _f(s.sent_rps, "{:.3f}"))
    run.add_row("throughput (req/s)", _f(s.throughput_rps, "{:.3f}"))
    run.add_row("output tokens/s", _f(s.output_tokens_per_s))
    run.add_row("prompt / output tokens", f"{s.prompt_tokens} / {s.output_tokens}")
    if s.slo_tpot_ms is not None:
        run.add_row(f"goodput (req/s, TPOT <= {s.slo_tpot_ms:g} ms)", _f(s.goodput_rps, "{:.3f}"))
    run.add_row("max send lag (ms)", _f(s.max_send_lag_ms))
    for key, n in s.errors.items():
        run.add_row(f"errors: {key}", str(n))
    console.print(run)
    if s.rate_note:
        console.print(s.rate_note, soft_wrap=True, markup=False)
    sv = s.server
    if sv is None:
        console.print("server /metrics: not available")
        return
    title = "Server counters over the run (/metrics after - before)"
    srv = Table(title=title, title_justify="left", show_header=False, min_width=len(title))
    srv.add_column("what")
    srv.add_column("value", justify="right")
    srv.add_row(
        "expert lookups / hits", f"{_f(sv.expert_lookups, '{:.0f}')} / {_f(sv.expert_hits, '{:.0f}')}"
    )
    srv.add_row("buffer hit rate", _f(sv.hit_rate, "{:.4f}"))
    srv.add_row("blocking time (s)", _f(sv.blocking_s, "{:.3f}"))
    for reason, n in sv.success_by_reason.items():
        srv.add_row(f"requests finished: {reason}", f"{n:.0f}")
    srv.add_row("generation tokens", _f(sv.generation_tokens, "{:.0f}"))
    for kind, b in sv.transfer_bytes.items():
        srv.add_row(f"transfer MB ({kind})", f"{b / 1e6:.1f}")
    console.print(srv)
