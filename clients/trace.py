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
