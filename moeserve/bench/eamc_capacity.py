"""``moeserve bench eamc --capacities ...``: what the EAMC's prediction gains from more entries
against what matching costs.

MoE-Infinity §7.5 (Figure 13) finds that a small collection, about 120 entries or 3% of the
requests served, gives every model its lowest latency. This measures both sides on our code, per
capacity:

* **prediction** (with ``--traces WARM EVAL``, once per workload) -- ``tracer.predict_eval``, the
  protocol of ``moeserve trace predict-eval`` with ``--k`` matches per query, on request traces
  recorded with ``moeserve trace record``: the EAMC's precision one and two layers ahead beside
  the request's own EAM (the ``eam`` policy's own term, which needs no collection). Warm requests
  fill the collection in file order; once it is full each replaces its most similar entry (§4.2),
  as in serving. Deterministic: computed once.
* **matching cost** -- the ``eam`` policy's incremental matcher (``tracer.prefix_match``) at
  ``--layers`` x ``--experts`` and batch ``--batch`` against a collection filled to capacity with
  synthetic EAMs: ``begin_step`` (the full match a step pays when its batch changed) and one
  layer's ``update_rows`` (each later plan with the EAMC term). Thread CPU time after a warm-up
  call, median and spread of ``--repeats`` calls (``update_rows``: ten times as many).

The table in docs/tracer.md used two workloads of the bundled model, at the Qwen3-30B-A3B shape::

    P=../shared/data/prompts/prompts_combined.jsonl
    moeserve trace record --prompts $P --tasks 120 --per-task 12 --max-tokens 24 --batch 16 --seed 0 --out runs/eamc/a-warm.jsonl
    moeserve trace record --prompts $P --tasks 120 --per-task 2 --skip 12 --max-tokens 24 --batch 16 --seed 0 --out runs/eamc/a-eval.jsonl
    moeserve trace record --prompts $P --tasks 400 --per-task 3 --max-tokens 24 --batch 16 --seed 1 --out runs/eamc/b-warm.jsonl
    moeserve trace record --prompts $P --tasks 400 --per-task 1 --skip 3 --max-tokens 24 --batch 16 --seed 1 --out runs/eamc/b-eval.jsonl
    moeserve bench eamc --capacities 32,64,128,256,512,1000 --layers 48 --experts 128 --batch 16 --k 16 \\
        --repeats 5 --traces runs/eamc/a-warm.jsonl runs/eamc/a-eval.jsonl \\
        --traces runs/eamc/b-warm.jsonl runs/eamc/b-eval.jsonl --json
"""  # noqa: E501

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from tracer.eamc import EAMC
from tracer.prefix_match import PrefixMatcher
from tracer.synth import synthetic_eams


def precision(warm: list, evals: list, capacity: int, matches: int) -> dict[str, float]:
    """``{"eamc d=1", "eamc d=2", "own d=1", "own d=2"}`` precision at ``capacity``."""
    from tracer.predict_eval import evaluate

    rows = evaluate(warm, evals, distances=(1, 2), matches=matches, capacity=capacity)["rows"]
    names = {"eamc": "eamc", "request-eam": "own"}
    return {f"{names[r['method']]} d={r['d']}": r["precision"] for r in rows if r["method"] in names}


def _cpu_us(fn, repeats: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Median, min and max thread CPU time (us) of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return float(np.median(times) * 1e6), min(times) * 1e6, max(times) * 1e6


def matching_cost(
    capacity: int, layers: int, experts: int, batch: int, matches: int, repeats: int, seed: int = 0
) -> dict[str, float]:
    """``begin_step`` and one layer's ``update_rows`` (us of thread CPU time: median, ``_min``,
    ``_max`` of ``repeats`` calls after one warm-up call; ``update_rows`` ten times as many) of a
    :class:`PrefixMatcher` with ``matches`` matches against a full collection of ``capacity``."""
    eamc = EAMC(layers, experts, capacity=capacity)
    for eam in synthetic_eams(capacity, layers, experts, top_k=min(8, experts), seed=seed):
        eamc.add(eam)
    rng = np.random.default_rng(seed)
    query = rng.poisson(0.5, size=(batch, layers, experts)).astype(np.float32)  # a batch's EAMs so far
    m = PrefixMatcher(eamc, k=matches)
    layer = min(7, layers - 1)
    rows = query[:, layer : layer + 1].copy()
    begin = lambda: m.begin_step(query)  # noqa: E731
    update = lambda: m.update_rows([layer], rows)  # noqa: E731
    begin()  # warm-up
    update()
    out = {}
    for name, fn, n in (("begin_step_us", begin, repeats), ("update_rows_us", update, repeats * 10)):
        out[name], out[f"{name}_min"], out[f"{name}_max"] = _cpu_us(fn, n)
    return out


def run_capacities(args: argparse.Namespace) -> dict:
    """Precision per workload of ``args.traces`` and matching cost, per capacity of ``args.capacities``."""
    from tracer.trace_file import load_traces

    loads = [(Path(w).stem, load_traces(Path(w)), load_traces(Path(e))) for w, e in args.traces or []]
    rows = []
    for cap in args.capacities:
        row: dict = {"capacity": cap}
        for name, warm, evals in loads:
            row[name] = precision(warm, evals, cap, args.k)
        row.update(matching_cost(cap, args.layers, args.experts, args.batch, args.k, args.repeats, args.seed))
        rows.append(row)
        print(f"capacity {cap} done", file=sys.stderr, flush=True)
    settings: dict = {}
    if loads:
        first = loads[0][1][0]
        settings["traces"] = f"{first.num_layers} layers, {first.num_experts} experts, top-{first.top_k}"
        settings["workloads"] = {name: {"warm": len(w), "eval": len(e)} for name, w, e in loads}
    settings.update(
        matches=args.k,
        cost_shape=f"{args.layers} layers, {args.experts} experts, batch {args.batch}",
        repeats=args.repeats,
        warmup="one begin_step and one update_rows call per capacity, not timed",
        timing="thread CPU time, median [min-max]",
        seed=args.seed,
        host=f"{platform.machine()}, python {platform.python_version()}, {os.cpu_count()} CPUs",
        load_avg_1min=round(os.getloadavg()[0], 2),
    )
    return {"settings": settings, "rows": rows}


def render_capacities(result: dict) -> str:
    """Markdown table of :func:`run_capacities`' result, settings beside it."""
    s = result["settings"]
    names = list(s.get("workloads", {}))
    head = ["capacity"]
    for name in names:
        head += [f"{name}: EAMC d=1", "d=2", "own EAM d=1"]
    head += ["begin_step ms", "update_rows us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [str(row["capacity"])]
        for name in names:
            p = row[name]
            cells += [f"{p['eamc d=1']:.3f}", f"{p['eamc d=2']:.3f}", f"{p['own d=1']:.3f}"]
        b, u = (row[k] for k in ("begin_step_us", "update_rows_us"))
        cells.append(
            f"{b / 1e3:.2f} [{row['begin_step_us_min'] / 1e3:.2f}-{row['begin_step_us_max'] / 1e3:.2f}]"
        )
        cells.append(f"{u:.0f} [{row['update_rows_us_min']:.0f}-{row['update_rows_us_max']:.0f}]")
        lines.append("| " + " | ".join(cells) + " |")
    loads = ", ".join(
        f"{n}: {v['warm']} warm / {v['eval']} eval requests" for n, v in s.get("workloads", {}).items()
    )
    traces = f"traces of {s['traces']} ({loads}), " if names else ""
    lines += [
        "",
        f"Settings: {traces}`matches={s['matches']}`; matching cost at {s['cost_shape']}, {s['timing']} of "
        f"{s['repeats']} calls (`update_rows`: {10 * s['repeats']}) after a warm-up call, {s['host']}, "
        f"load average {s['load_avg_1min']}.",
    ]
    return "\n".join(lines) + "\n"
