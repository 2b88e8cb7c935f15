"""``moeserve bench policies`` over a grid: several ``--link-gbps`` and ``--batch`` values in one run.

The target this grid checks: ``eam`` (the default) no slower than on-demand+LRU beyond noise, the
paired TPOT ratio at most :data:`~moeserve.bench.policy_summary.TPOT_RATIO_TARGET` (1.02), at every
emulated link, buffer and batch size, e.g.::

    moeserve bench policies --policies on-demand+lru,eam --link-gbps 0.5,4,32,0 --batch 1,4,16 \\
        --tasks 8 --warm 2 --eval 2 --new-tokens 16 --min-batches 4 --json > grid.json

Each (link, batch) point is one ``bench policies`` measurement (its own warm-up and round-robin
repeats), run one after another in this process; the JSON holds every point (:func:`run_grid`)
and :func:`render_grid` turns it into the verdict table. ``--min-batches N`` raises a point's warm
and eval prompts per task so that each fills at least ``N`` batches (:func:`prompts_per_task`):
with 8 tasks and 2 eval prompts per task, batch 16 would otherwise warm on one batch and measure
one more, inside the ``eam`` trial's first exploration (``moe_runtime.prefetch.trial.ModeTrial``
measures its arms over about 45 decode steps before its first choice).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

from moeserve.bench.policy_summary import BASELINE, DEFAULT, TPOT_RATIO_TARGET

VERDICTS = ("met", "within noise", "not met", "missing")
#: Settings that differ from point to point by design (the tasks and prompts scale with the batch).
PER_POINT = (
    "batch", "link_gbps", "load_avg_before", "load_avg_after", "wall_s", "warm_prompts", "eval_prompts",
    "tasks",
)  # fmt: skip


def floats(text: str) -> list[float]:
    """``"0.5,4,0"`` -> ``[0.5, 4.0, 0.0]`` (argparse type; a bad value is a parser error)."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers expected") from None


def ints(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``, each >= 1 (argparse type)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers expected") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def link_text(link: float | None) -> str:
    """``0.5``, ``4``, ``32``, or ``off`` for no emulated link (0 or None)."""
    return "off" if not link else f"{link:g}"


def prompts_per_task(per_task: int, batch: int, tasks: int, min_batches: int) -> int:
    """``per_task`` prompts per task (``--warm`` or ``--eval``), raised so that ``tasks`` tasks fill
    at least ``min_batches`` batches of ``batch`` (0: never raised)."""
    return max(per_task, -(-min_batches * batch // tasks))


def point_args(args: argparse.Namespace, link: float, batch: int) -> argparse.Namespace:
    """``args`` for one point: scalar ``link_gbps`` and ``batch``, warm and eval prompts raised to
    ``--min-batches``."""
    out = argparse.Namespace(**vars(args))
    out.link_gbps, out.batch = link, batch
    out.warm = prompts_per_task(args.warm, batch, args.tasks, args.min_batches)
    out.eval = prompts_per_task(args.eval, batch, args.tasks, args.min_batches)
    return out


def run_grid(args: argparse.Namespace, measure_point) -> dict:  # type: ignore[no-untyped-def]
    """Every (link, batch) point of ``args.link_gbps`` x ``args.batch`` in that order, each through
    ``measure_point(point args) -> {"settings", "results", "verdicts"}``. Returns ``{"grid": {...},
    "points": [...]}``; progress goes to stderr."""
    points = [(g, b) for g in args.link_gbps for b in args.batch]
    t0 = time.monotonic()
    out = []
    for i, (link, batch) in enumerate(points, 1):
        print(f"[{i}/{len(points)}] link {link_text(link)}, batch {batch}", file=sys.stderr, flush=True)
        out.append(measure_point(point_args(args, link, batch)))
    grid = {
        "links_gbps": args.link_gbps,
        "batches": args.batch,
        "min_batches": args.min_batches,
        "order": "points one after another (links outer, batches inner); each point's rows round-robin",
        "wall_s": round(time.monotonic() - t0, 1),
    }
    return {"grid": grid, "points": out}


def verdict(ratio: float, ratio_max: float, bound: float = TPOT_RATIO_TARGET) -> str:
    """The target on the paired TPOT ratio eam / on-demand+LRU: "met" when the slowest round's ratio
    is at most ``bound``, "within noise" when only the median is, else "not met" (the median above
    ``bound``)."""
    if ratio_max <= bound:
        return "met"
    return "within noise" if ratio <= bound else "not met"


def _fmt(d: dict, key: str, fmt: str = "{:.2f}") -> str:
    from moeserve.bench.render import fmt_key

    return fmt_key(d, key, fmt)


def _row(link: float | None, batch: int, fraction: float, data: dict) -> tuple[list[str], str]:
    """One table row and its verdict; "missing" when one of the point's two rows is absent."""
    head = [link_text(link), str(batch), f"{fraction:.0%}"]
    get = lambda p: next(  # noqa: E731
        (r for r in data["results"] if abs(r["buffer_fraction"] - fraction) < 1e-9 and r["policy"] == p), None
    )
    eam, base = get(DEFAULT), get(BASELINE)
    if eam is None or base is None or eam.get("tpot_vs_on_demand") is None:
        what = f"no {DEFAULT if eam is None else BASELINE} row"
        return head + [f"missing ({what})"] + [""] * 5 + ["missing"], "missing"
    v = verdict(eam["tpot_vs_on_demand"], eam["tpot_vs_on_demand_max"])
    share = eam.get("prefetch_on_share")
    arms = eam.get("arm_shares")
    return head + [
        f"{base['buffer_slots']}",
        _fmt(eam, "tpot_ms"),
        _fmt(base, "tpot_ms"),
        _fmt(eam, "tpot_vs_on_demand", "{:.3f}"),
        "" if share is None else f"{share:.2f}",
        ", ".join(f"{a} {x:.2f}" for a, x in sorted(arms.items())) if arms else "",
        v,
    ], v


def _settings(points: list[dict]) -> tuple[str, str]:
    """Per point, in one sentence: the tasks and prompts per batch size (a larger batch takes tasks
    with more prompts, and more of them), the 1-minute load averages and the wall time; and the
    settings every point shares (or the keys in which they differ)."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for d in points:
        s = d["settings"]
        got = groups.setdefault((len(s["tasks"]), s["warm_prompts"], s["eval_prompts"]), [])
        if str(s["batch"]) not in got:
            got.append(str(s["batch"]))
    per_batch = "; ".join(
        f"batch {', '.join(b)}: {t} tasks, {w} warm and {e} eval prompts" for (t, w, e), b in groups.items()
    )
    loads = [
        x[0] for d in points for k in ("load_avg_before", "load_avg_after") if (x := d["settings"].get(k))
    ]
    load = f"{min(loads)}-{max(loads)}" if loads else "n/a"
    walls = [d["settings"]["wall_s"] for d in points]
    sentence = f"{per_batch}; 1-minute load average {load}; {min(walls):.0f}-{max(walls):.0f} s a point"
    first = points[0]["settings"]
    keys = [k for k in first if k not in PER_POINT]
    same = [k for k in keys if all(d["settings"].get(k) == first[k] for d in points)]
    shared = ", ".join(f"`{k}={v}`" for k in same if (v := first[k]) is not None)
    differ = [k for k in keys if k not in same]
    if differ:
        shared += "; **the points differ in** " + ", ".join(f"`{k}`" for k in differ)
    return sentence, shared


def render_grid(data: dict) -> str:
    """Markdown of :func:`run_grid`'s JSON: the verdict count, one row per (link, batch, buffer)
    (eam and on-demand+LRU TPOT and their paired ratio, median [min, max] over rounds; the share of
    decode steps the eam trial prefetched, per arm where recorded; the verdict), the settings per
    point and those every point shares. Raises ValueError for a grid without points."""
    from moeserve.bench.render import md_table

    points = data.get("points") or []
    if not points:
        raise ValueError("no point in the grid")
    header = ["link GB/s", "batch", "buffer", "slots", "eam TPOT ms", "on-demand+lru TPOT ms",
              "eam / on-demand (paired)", "prefetch on", "arm shares", "verdict"]  # fmt: skip
    rows, counts = [], dict.fromkeys(VERDICTS, 0)
    for d in points:
        s = d["settings"]
        for f in sorted({r["buffer_fraction"] for r in d["results"] if r["policy"] != "all-resident"}):
            row, v = _row(s["link_gbps"], s["batch"], f, d)
            rows.append(row)
            counts[v] += 1
    if not any(r[8] for r in rows):
        header, rows = header[:8] + header[9:], [r[:8] + r[9:] for r in rows]  # no arm shares recorded
    settings, shared = _settings(points)
    count = ", ".join(f"{n} {v}" for v, n in counts.items())
    wall = sum(d["settings"]["wall_s"] for d in points)
    min_batches = data.get("grid", {}).get("min_batches")
    fill = f"; each point's warm and eval prompts fill at least {min_batches} batches" if min_batches else ""
    return (
        f"**{count}** ({len(rows)} rows). Verdict on the paired ratio eam / on-demand+LRU: met when the "
        f"slowest round is at most {TPOT_RATIO_TARGET}, within noise when only the median is, not met "
        f"when the median is above it.\n\n{md_table(header, rows).rstrip()}\n\n"
        f"Per point ({wall / 60:.1f} minutes of measurement in all{fill}): {settings}. "
        f"Shared by every point: {shared}.\n"
    )


def as_point(settings: dict, rows: list, comparisons: list[dict]) -> dict:
    """One point as ``bench policies --json`` prints it."""
    return {"settings": settings, "results": [asdict(r) for r in rows], "verdicts": comparisons}
