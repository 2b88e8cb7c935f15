"""Repeated ``bench policies`` runs reduced to medians, spreads and verdicts that respect the noise.

A (buffer size, policy) row is run ``repeats`` times; repeat ``i`` of every row of one buffer size
ran in the same round (round-robin), so ratios against ``on-demand+lru`` are *paired*: repeat ``i``
of a row divided by repeat ``i`` of on-demand. A row reports, per metric, the median over repeats
and the spread (fastest and slowest repeat). A comparison or target is decided only when the
spread clears it; otherwise the verdict is "within noise".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from moeserve.sim.report import add_relative, gap_closed

#: Figures summarised per row: median, min and max over repeats.
METRICS = ("hit_rate", "blocking_ms_per_token", "bytes_per_token", "tpot_ms")
#: Figures summarised as :data:`METRICS` are where every repeat has them (results written before
#: they existed lack them): compute-thread CPU ms and expert batches per decode step.
OPTIONAL_METRICS = ("cpu_ms", "expert_batches_per_step")
#: Counters reported as the median over repeats.
COUNTS = ("prefetch_issued", "prefetch_landed", "prefetch_used", "tokens")
BASELINE, ORACLE, DEFAULT = "on-demand+lru", "oracle", "eam"
#: The default policy's targets: eam TPOT / on-demand+LRU TPOT at most this, in every row ...
TPOT_RATIO_TARGET = 1.02
#: ... and at least this share of the on-demand -> oracle TPOT gap closed (at 25%, 0.5 GB/s).
GAP_CLOSED_TARGET = 0.5


@dataclass
class PolicyRow:
    """One (buffer size, policy) row over ``repeats`` runs. Per metric of :data:`METRICS`: the
    median (plain name) and the spread (``_min``, ``_max``); ``runs`` keeps every repeat in round
    order. Units: hit rate 0..1, blocking ms per generated token, bytes per token, TPOT ms."""

    buffer_fraction: float
    buffer_slots: int
    policy: str
    hit_rate: float
    hit_rate_min: float
    hit_rate_max: float
    blocking_ms_per_token: float
    blocking_ms_per_token_min: float
    blocking_ms_per_token_max: float
    bytes_per_token: float
    bytes_per_token_min: float
    bytes_per_token_max: float
    tpot_ms: float
    tpot_ms_min: float
    tpot_ms_max: float
    prefetch_issued: float
    prefetch_landed: float
    prefetch_used: float
    tokens: float
    runs: dict[str, list[float]] = field(default_factory=dict)
    tpot_vs_on_demand: float | None = None  # median of the paired per-round ratios
    tpot_vs_on_demand_min: float | None = None
    tpot_vs_on_demand_max: float | None = None
    # median and spread of the per-round gap closed (paired by round, as the ratio; from the
    # median TPOTs of this row, on-demand+lru and oracle when a round has no gap to close)
    gap_closed: float | None = None
    gap_closed_min: float | None = None
    gap_closed_max: float | None = None
    bytes_vs_oracle: float | None = None  # median bytes per token / the oracle's
    # median share of measured decode steps the runtime's eam trial ran with prefetching on
    prefetch_on_share: float | None = None
    # median share of measured decode steps per arm of that trial ({arm: share})
    arm_shares: dict[str, float] | None = None
    # OPTIONAL_METRICS, median and spread where every repeat has them: compute-thread CPU ms per
    # decode step, expert batches per decode step
    cpu_ms: float | None = None
    cpu_ms_min: float | None = None
    cpu_ms_max: float | None = None
    expert_batches_per_step: float | None = None
    expert_batches_per_step_min: float | None = None
    expert_batches_per_step_max: float | None = None


def _get(r: Any, key: str) -> Any:
    return r[key] if isinstance(r, dict) else getattr(r, key)


def _get_optional(r: Any, key: str) -> Any:
    """``key`` of ``r``, or None where it is absent (results written before it existed)."""
    return r.get(key) if isinstance(r, dict) else getattr(r, key, None)


def _bounds(r: Any, key: str) -> tuple[Any, Any]:
    return _get(r, key + "_min"), _get(r, key + "_max")


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``. Raises ValueError when empty."""
    if not values:
        raise ValueError("spread of no values")
    return statistics.median(values), min(values), max(values)


def paired(a: Any, b: Any, metric: str, diff: bool = False) -> tuple[float, float, float]:
    """(median, min, max) over rounds of ``a``'s repeat ``i`` / ``b``'s repeat ``i`` (``a - b`` with
    ``diff``) for ``metric``; ``a`` and ``b`` are rows (objects or dicts) with ``runs``. Raises
    ValueError when their repeat counts differ, ZeroDivisionError on a zero in ``b``."""
    xs, ys = _get(a, "runs")[metric], _get(b, "runs")[metric]
    return spread([x - y if diff else x / y for x, y in zip(xs, ys, strict=True)])


def summarise(repeats: list[list[Any]]) -> list[PolicyRow]:
    """Rows of medians and spreads from ``repeats[i]`` = the results of round ``i`` (objects or
    dicts with ``buffer_fraction``, ``buffer_slots``, ``policy`` and :data:`METRICS` /
    :data:`COUNTS`). Every round must hold the same (buffer, policy) rows; raises ValueError if not.
    Ratios to on-demand and gap closed are paired by round (median and spread of the per-round
    figures, so the median lies within its spread); ``bytes_vs_oracle``, and ``gap_closed``
    when a round has no gap to close, come from the medians (``add_relative``)."""
    if not repeats:
        raise ValueError("no repeats to summarise")
    keyed = [{(_get(r, "buffer_fraction"), _get(r, "policy")): r for r in rnd} for rnd in repeats]
    if any(k.keys() != keyed[0].keys() for k in keyed):
        raise ValueError("every repeat must hold the same (buffer, policy) rows")
    rows = []
    for key, first in keyed[0].items():
        per = [k[key] for k in keyed]
        runs = {m: [float(_get(r, m)) for r in per] for m in METRICS}
        figures = {}
        for m in METRICS:
            figures[m], figures[m + "_min"], figures[m + "_max"] = spread(runs[m])
        for m in OPTIONAL_METRICS:
            values = [_get_optional(r, m) for r in per]
            if all(v is not None for v in values):
                runs[m] = [float(v) for v in values]
                figures[m], figures[m + "_min"], figures[m + "_max"] = spread(runs[m])
        counts = {c: statistics.median(_get(r, c) for r in per) for c in COUNTS}
        shares = [v for r in per if (v := _get_optional(r, "prefetch_on_share")) is not None]
        share = statistics.median(shares) if shares else None
        by_arm = [v for r in per if (v := _get_optional(r, "arm_shares"))]
        arm_shares = None
        if by_arm:
            arm_shares = {a: statistics.median(d.get(a, 0.0) for d in by_arm) for a in by_arm[0]}
        rows.append(
            PolicyRow(
                key[0],
                _get(first, "buffer_slots"),
                key[1],
                **figures,
                **counts,
                runs=runs,
                prefetch_on_share=share,
                arm_shares=arm_shares,
            )  # fmt: skip
        )
    add_relative(rows, group="buffer_fraction")
    _add_paired(rows)
    return rows


def _add_paired(rows: list[PolicyRow]) -> None:
    """Per-round TPOT ratio to on-demand and per-round gap closed, as median and spread."""
    for fraction in {r.buffer_fraction for r in rows}:
        block = [r for r in rows if r.buffer_fraction == fraction]
        base = next((r for r in block if r.policy == BASELINE), None)
        oracle = next((r for r in block if r.policy == ORACLE), None)
        if base is None:
            continue
        for r in block:
            r.tpot_vs_on_demand, r.tpot_vs_on_demand_min, r.tpot_vs_on_demand_max = paired(r, base, "tpot_ms")
            if oracle is None:
                continue
            tpots = zip(r.runs["tpot_ms"], base.runs["tpot_ms"], oracle.runs["tpot_ms"], strict=True)
            gaps = [gap_closed(t, b, o) for t, b, o in tpots]
            if None not in gaps:
                r.gap_closed, r.gap_closed_min, r.gap_closed_max = spread(gaps)


def compare(lo_a: float, hi_a: float, lo_b: float, hi_b: float, lower: str, higher: str) -> str:
    """``lower`` when spread a lies wholly below spread b, ``higher`` when wholly above, else
    "within noise" (the spreads overlap)."""
    if hi_a < lo_b:
        return lower
    if lo_a > hi_b:
        return higher
    return "within noise"


def target(lo: float | None, hi: float | None, bound: float, at_most: bool) -> str:
    """Verdict on a target ``<= bound`` (``at_most``) or ``>= bound``: "met" only when the whole
    spread ``[lo, hi]`` clears it, "not met" when none of it does, else "within noise"."""
    if lo is None or hi is None:
        return "n/a"
    ok_lo, ok_hi = (hi <= bound, lo > bound) if at_most else (lo >= bound, hi < bound)
    return "met" if ok_lo else "not met" if ok_hi else "within noise"


def verdicts(rows: list[PolicyRow | dict], policy: str = DEFAULT) -> list[dict[str, Any]]:
    """Per buffer size: ``policy`` against on-demand+lru (TPOT and blocking, decided only when the
    spreads separate) and the default policy's targets (TPOT ratio <= 1.02; gap closed >= 0.5) judged on the
    paired spreads. Buffer sizes without both rows are skipped."""
    out = []
    for fraction in sorted({_get(r, "buffer_fraction") for r in rows}):
        block = {_get(r, "policy"): r for r in rows if _get(r, "buffer_fraction") == fraction}
        if policy not in block or BASELINE not in block:
            continue
        p, b = block[policy], block[BASELINE]
        out.append(
            {
                "buffer_fraction": fraction,
                "policy": policy,
                "tpot": compare(*_bounds(p, "tpot_ms"), *_bounds(b, "tpot_ms"), "faster", "slower"),
                "blocking": compare(
                    *_bounds(p, "blocking_ms_per_token"), *_bounds(b, "blocking_ms_per_token"), "less", "more"
                ),
                **{
                    f"{prefix}{m}{end}": _get(r, m + end)
                    for prefix, r in (("", p), ("on_demand_", b))
                    for m in ("tpot_ms", "blocking_ms_per_token")
                    for end in ("", "_min", "_max")
                },
                "tpot_ratio": _get(p, "tpot_vs_on_demand"),
                "tpot_ratio_min": _get(p, "tpot_vs_on_demand_min"),
                "tpot_ratio_max": _get(p, "tpot_vs_on_demand_max"),
                "tpot_ratio_target": TPOT_RATIO_TARGET,
                "tpot_ratio_verdict": target(*_bounds(p, "tpot_vs_on_demand"), TPOT_RATIO_TARGET, True),
                "gap_closed": _get(p, "gap_closed"),
                "gap_closed_min": _get(p, "gap_closed_min"),
                "gap_closed_max": _get(p, "gap_closed_max"),
                "gap_closed_target": GAP_CLOSED_TARGET,
                "gap_closed_verdict": target(*_bounds(p, "gap_closed"), GAP_CLOSED_TARGET, False),
            }
        )
    return out
