"""Request arrivals: the Azure LLM inference trace (time-scaled) or a Poisson process.

The Azure LLM inference trace 2023 (Patel et al., "Splitwise", ISCA'24) is a CSV with header
``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is wall-clock time
``YYYY-MM-DD HH:MM:SS[.fffffff]`` (up to 7 fractional digits), rows in ascending time order.

NOTE: scaling keeps the trace's burstiness. With ``rps`` the whole trace is compressed or stretched
by one factor, ``speedup = rps / native_rate`` where ``native_rate = (n - 1) / span`` over the whole
file, so the *average* offered rate is ``rps`` while the local bursts and lulls keep their shape.
A short ``duration`` window may therefore offer a rate somewhat above or below ``rps``; the report
prints the rate actually offered.
"""

from __future__ import annotations

import csv
import io
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from clients.errors import ClientError

TRACE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(slots=True, frozen=True)
class TraceRow:
    """One request of a trace file.

    Attributes:
        offset_s: seconds since the file's first request (>= 0, non-decreasing).
        context_tokens: prompt length in the trace, tokens.
        generated_tokens: output length in the trace, tokens.
    """

    offset_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(slots=True, frozen=True)
class Arrival:
    """One request to send.

    Attributes:
        index: position in the arrival schedule (0-based).
        time_s: when to send it, seconds after the run starts.
        context_tokens: prompt length to aim for, tokens; ``None`` = use the prompt as drawn.
        generated_tokens: output length to ask for, tokens; ``None`` = the run's default cap.
    """

    index: int
    time_s: float
    context_tokens: int | None
    generated_tokens: int | None


def _parse_timestamp(text: str) -> float:
    """``YYYY-MM-DD HH:MM:SS[.f...]`` -> POSIX seconds (naive, treated as UTC)."""
    base, _, frac = text.strip().partition(".")
    try:
        dt = datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        dt = None
    if dt is None or (frac and not frac.isdigit()):
        raise ValueError(f"TIMESTAMP {text!r} is not YYYY-MM-DD HH:MM:SS[.fffffff]")
    return (dt - datetime(1970, 1, 1)).total_seconds() + (float(f"0.{frac}") if frac else 0.0)


def _nonneg_int(value: str, column: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{column} {value!r} is not an integer") from None
    if n < 0:
        raise ValueError(f"{column} {n} is negative")
    return n


def load_azure_trace(path: Path) -> list[TraceRow]:
    """Read an Azure LLM inference trace CSV.

    Returns:
        rows in file order, offsets relative to the first row.

    Raises:
        ClientError: missing file, wrong header, a row with a bad timestamp or token count, a
            timestamp earlier than the row before, or no rows; the message names file and line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ClientError(f"{path}: cannot open trace ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ClientError(f"{path}: not UTF-8 text ({exc.reason})") from None
    rows: list[TraceRow] = []
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != TRACE_HEADER:
        raise ClientError(f"{path}:1: expected header {','.join(TRACE_HEADER)}, got {header!r}")
    first = prev = 0.0
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 3:
            raise ClientError(f"{path}:{line}: expected 3 columns, got {len(row)}: {row!r}")
        try:
            ts = _parse_timestamp(row[0])
            ctx = _nonneg_int(row[1], "ContextTokens")
            gen = _nonneg_int(row[2], "GeneratedTokens")
        except ValueError as exc:
            raise ClientError(f"{path}:{line}: {exc}") from None
        if not rows:
            first = prev = ts
        if ts < prev:
            raise ClientError(f"{path}:{line}: TIMESTAMP {row[0].strip()} is earlier than the row before")
        prev = ts
        rows.append(TraceRow(offset_s=ts - first, context_tokens=ctx, generated_tokens=gen))
    if not rows:
        raise ClientError(f"{path}: trace has a header but no rows")
    return rows


def skip(rows: list[TraceRow], offset_s: float) -> list[TraceRow]:
    """Rows from ``offset_s`` seconds of trace time on, re-based so the first is at 0.

    Raises:
        ClientError: no row is left.
    """
    if offset_s <= 0:
        return rows
    kept = [r for r in rows if r.offset_s >= offset_s]
    if not kept:
        raise ClientError(
            f"--trace-offset {offset_s:g} s is past the trace's end ({rows[-1].offset_s:.1f} s)"
        )
    base = kept[0].offset_s
    return [TraceRow(r.offset_s - base, r.context_tokens, r.generated_tokens) for r in kept]


def native_rate(rows: list[TraceRow]) -> float:
    """Average arrival rate of a trace, requests/s (``(n - 1) / span``; ``inf`` for a zero span)."""
    span = rows[-1].offset_s - rows[0].offset_s
    return math.inf if span <= 0 else (len(rows) - 1) / span


def scale_trace(
    rows: list[TraceRow], rps: float | None = None, speedup: float | None = None
) -> list[Arrival]:
    """Time-scale trace rows to a target average rate or by a speed-up factor.

    Args:
        rps: target average rate, requests/s (``speedup = rps / native_rate``).
        speedup: divide every offset by this (2 = twice the rate); exclusive with ``rps``. Neither =
            real time.

    Raises:
        ClientError: both given, or a non-positive value.
    """
    if rps is not None and speedup is not None:
        raise ClientError("give --rps or --speedup, not both")
    if rps is not None:
        if not rps > 0:
            raise ClientError(f"--rps must be > 0, got {rps}")
        rate = native_rate(rows)
        speedup = 1.0 if math.isinf(rate) else rps / rate
    if speedup is None:
        speedup = 1.0
    if not speedup > 0:
        raise ClientError(f"--speedup must be > 0, got {speedup}")
    return [
        Arrival(i, r.offset_s / speedup, r.context_tokens, r.generated_tokens) for i, r in enumerate(rows)
    ]


def poisson_arrivals(
    rps: float, duration_s: float | None, max_requests: int | None, seed: int
) -> list[Arrival]:
    """Poisson arrivals (exponential gaps, mean ``1/rps`` s), first one at 0.

    Stops at ``duration_s`` seconds or ``max_requests`` requests, whichever comes first.

    Raises:
        ClientError: ``rps`` not > 0, or neither bound given.
    """
    if not rps > 0:
        raise ClientError(f"--rps must be > 0, got {rps}")
    if duration_s is None and max_requests is None:
        raise ClientError("without --trace, give --duration or --max-requests")
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = 0.0
    while (duration_s is None or t < duration_s) and (max_requests is None or len(out) < max_requests):
        out.append(Arrival(len(out), t, None, None))
        t += rng.expovariate(rps)
    return out


def window(arrivals: list[Arrival], duration_s: float | None, max_requests: int | None) -> list[Arrival]:
    """Arrivals before ``duration_s`` seconds, at most ``max_requests`` of them."""
    out = [a for a in arrivals if duration_s is None or a.time_s < duration_s]
    return out if max_requests is None else out[:max_requests]


def offered_rate(times_s: list[float]) -> float | None:
    """Rate of a list of send times, requests/s: ``(n - 1) / (last - first)``.

    ``None`` for fewer than two times or a zero span (no rate to speak of).
    """
    if len(times_s) < 2:
        return None
    span = max(times_s) - min(times_s)
    return (len(times_s) - 1) / span if span > 0 else None


@dataclass(slots=True, frozen=True)
class Schedule:
    """The arrivals of a run and how they were made, to tell why the offered rate is what it is.

    Attributes:
        arrivals: the requests to send, in time order.
        source: ``"trace"`` or ``"poisson"``.
        target_rps: the average rate asked for, requests/s: ``--rps``, or with ``--speedup`` (or
            neither) the trace's average times the speed-up.
        target_label: how the target was asked for, e.g. ``--rps 1`` or ``--speedup 2 (11.1 req/s)``.
        native_rps: trace only: the average rate of the rows the scaling is computed over (the
            file after ``--trace-offset``), requests/s.
        speedup: trace only: trace time divided by this is run time.
        trace_start_s: trace only: the first kept row's time in the file (after ``--trace-offset``), s.
        trace_name: trace only: the file name.
        duration_s, max_requests: the window's bounds (``--duration``, ``--max-requests``).
    """

    arrivals: list[Arrival]
    source: str
    target_rps: float | None
    target_label: str
    native_rps: float | None = None
    speedup: float | None = None
    trace_start_s: float = 0.0
    trace_name: str = ""
    duration_s: float | None = None
    max_requests: int | None = None


def trace_schedule(
    rows: list[TraceRow],
    trace_name: str,
    rps: float | None,
    speedup: float | None,
    trace_offset_s: float,
    duration_s: float | None,
    max_requests: int | None,
) -> Schedule:
    """Skip ``trace_offset_s``, scale to ``rps`` (or by ``speedup``), keep the window.

    Raises:
        ClientError: as :func:`skip` and :func:`scale_trace`.
    """
    kept = skip(rows, trace_offset_s)
    arrivals = window(scale_trace(kept, rps=rps, speedup=speedup), duration_s, max_requests)
    native = native_rate(kept)
    finite = not math.isinf(native)
    if rps is not None:
        factor = rps / native if finite else 1.0
        target, label = rps, f"--rps {rps:g}"
    else:
        factor = speedup or 1.0
        target = native * factor if finite else None
        shown = "n/a" if target is None else f"{target:.3g}"
        label = f"--speedup {factor:g}" if speedup else "the trace's own rate"
        label += f" ({shown} req/s)"
    return Schedule(
        arrivals=arrivals,
        source="trace",
        target_rps=target,
        target_label=label,
        native_rps=native if finite else None,
        speedup=factor,
        trace_start_s=rows[len(rows) - len(kept)].offset_s,
        trace_name=trace_name,
        duration_s=duration_s,
        max_requests=max_requests,
    )


def poisson_schedule(rps: float, duration_s: float | None, max_requests: int | None, seed: int) -> Schedule:
    """:func:`poisson_arrivals` with what the report needs to explain their rate."""
    return Schedule(
        arrivals=poisson_arrivals(rps, duration_s, max_requests, seed),
        source="poisson",
        target_rps=rps,
        target_label=f"--rps {rps:g}",
        duration_s=duration_s,
        max_requests=max_requests,
    )


#: The offered rate is explained when it differs from the target by more than this fraction.
RATE_TOLERANCE = 0.10


def rate_note(
    schedule: Schedule,
    scheduled_rps: float | None,
    sent_rps: float | None = None,
    max_send_lag_ms: float | None = None,
    tolerance: float = RATE_TOLERANCE,
) -> str | None:
    """One line, ``offered X req/s against --rps R: <why>``, when the schedule's rate (or the rate
    the requests were actually sent at) differs from the target by more than ``tolerance``;
    ``None`` when they agree or there is no target.

    Why, from what the schedule was built of: a trace window runs at the trace's own local rate
    (the whole file's average is what ``--rps`` scales to, bursts and lulls are kept); a Poisson
    sample of few arrivals varies around its mean; one arrival has no rate; sends that fell
    behind their times lower the sent rate.
    """
    target, n = schedule.target_rps, len(schedule.arrivals)
    if target is None or not target > 0:
        return None
    if scheduled_rps is None:
        return (
            f"offered no rate against {schedule.target_label}: {n} request(s) in the window, "
            "a rate needs two at different times (a longer --duration"
            + (" or another --trace-offset)" if schedule.source == "trace" else ")")
        )
    why: list[str] = []
    if abs(scheduled_rps / target - 1) > tolerance:
        if schedule.source == "trace" and schedule.speedup and schedule.native_rps:
            last = schedule.arrivals[-1].time_s
            end = schedule.duration_s if schedule.duration_s is not None else last
            if schedule.max_requests is not None and n >= schedule.max_requests:
                what, end = f"the first {n} arrivals (--max-requests) cover", last
            elif schedule.duration_s is not None:
                what = f"the {schedule.duration_s:g} s window covers"
            else:
                what = "the run covers"
            a = schedule.trace_start_s
            b = a + end * schedule.speedup
            local = scheduled_rps / schedule.speedup
            side = "sparser" if local < schedule.native_rps else "denser"
            of = f"of {schedule.trace_name}" if schedule.trace_name else "of the trace"
            whole = "the file after --trace-offset" if schedule.trace_start_s > 0 else "the whole file"
            why.append(
                f"{what} seconds {a:.1f}-{b:.1f} {of}, where the trace runs at {local:.2f} req/s, "
                f"{side} than the {schedule.native_rps:.2f} req/s average of {whole} that the rate is "
                f"scaled from (time x{1 / schedule.speedup:.3g}, bursts and lulls kept); another "
                "--trace-offset or a longer window (--duration, --max-requests) comes closer"
            )
        elif schedule.source == "poisson":
            spread = 100 / math.sqrt(max(1, n - 1))
            why.append(
                f"a Poisson sample of {n} arrivals, whose rate varies by about +-{spread:.0f}% "
                "around the target; a longer --duration comes closer"
            )
    shown = scheduled_rps
    if sent_rps is not None and abs(sent_rps / scheduled_rps - 1) > tolerance:
        lag = "" if max_send_lag_ms is None else f" (up to {max_send_lag_ms:.0f} ms late)"
        why.append(
            f"the sends strayed from their schedule{lag}: sent at {sent_rps:.3g} req/s "
            f"against {scheduled_rps:.3g} req/s scheduled"
        )
        shown = sent_rps
    if not why:
        return None
    return f"offered {shown:.3g} req/s against {schedule.target_label}: " + "; ".join(why)
