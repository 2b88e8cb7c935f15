"""``moeserve bench eamc``: EAMC query latency (MoE-Infinity §6 "trace query cost").

Fills an EAMC to capacity with seeded synthetic request EAMs (:mod:`tracer.synth`), then times
``EAMC.search`` (row normalisation + faiss k-NN) at batch 1 and batch 16 after a warm-up, and the
``add`` of a full collection (a search for the most similar entry + an overwrite), and (flat
index) the incremental :class:`tracer.prefix_match.PrefixMatcher`: one ``begin_step`` per step
plus one ``update`` per MoE layer, amortised per layer. With
``--index ivf`` it also measures recall@k of the approximate index against the exact search on
the same queries. The paper reports 21 us per query at 1k entries and 226 us at 10k.

``--capacities`` measures instead, per capacity, the prediction precision on recorded traces
against the incremental matcher's cost (:mod:`moeserve.bench.eamc_capacity`).

The 1-minute load average is printed with the settings: on a shared host, other processes (on
the same core or its SMT sibling) can slow a search several-fold, so compare runs at similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import faiss
import numpy as np

from tracer.eamc import EAMC
from tracer.prefix_match import PrefixMatcher
from tracer.synth import synthetic_eams

PAPER_US = {1000: 21.0, 10000: 226.0}
_POOL = 64


def _median_us(fn: Any, iters: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return float(np.median(times) * 1e6), float(np.percentile(times, 90) * 1e6)


def fill(eamc: EAMC, seed: int, chunk: int = 1000, **synth: Any) -> float:
    """Fill ``eamc`` to capacity with synthetic EAMs (``synth``: :func:`synthetic_eams` options);
    returns seconds spent in ``add``."""
    spent = 0.0
    start = 0
    while len(eamc) < eamc.capacity:
        n = min(chunk, eamc.capacity - len(eamc))
        eams = synthetic_eams(
            n, eamc.num_layers, eamc.num_experts, seed=seed, request_seed=1000 + start, **synth
        )
        t0 = time.perf_counter()
        for e in eams:
            eamc.add(e)
        spent += time.perf_counter() - t0
        start += n
    return spent


def prefix_step(eamc: EAMC, pool: np.ndarray, batch: int, k: int, steps: int, seed: int) -> dict[str, float]:
    """Time :class:`PrefixMatcher` over ``steps`` engine steps (warm-up step first): ``begin_step``
    once per step, then ``update`` once per layer with one more token's counts in that row."""
    m = PrefixMatcher(eamc, k=k)
    rng = np.random.default_rng(seed)
    num_layers = eamc.num_layers
    begins, updates = [], []
    for s in range(steps + 1):
        at = (s * batch) % len(pool)
        so_far = pool[at : at + batch]
        step = rng.multinomial(2, np.full(eamc.num_experts, 1 / eamc.num_experts), size=(batch, num_layers))
        t0 = time.perf_counter()
        m.begin_step(so_far)
        t_begin = time.perf_counter() - t0
        query = so_far.copy()
        for layer in range(num_layers):
            query[:, layer] += step[:, layer]
            t0 = time.perf_counter()
            m.update(layer, query)
            if s:
                updates.append(time.perf_counter() - t0)
        if s:
            begins.append(t_begin)
    begin_us, update_us = float(np.median(begins) * 1e6), float(np.median(updates) * 1e6)
    return {
        "begin_step_median_us": round(begin_us, 1),
        "update_median_us": round(update_us, 1),
        "per_layer_us": round(begin_us / num_layers + update_us, 1),
        "steps": steps,
    }


def recall_at_k(eamc: EAMC, queries: np.ndarray, k: int) -> float:
    """Mean share of the exact top-``k`` (flat inner product) that ``eamc.search`` returns."""
    from tracer.eam import normalize_rows

    xq = normalize_rows(queries).reshape(len(queries), -1)
    xb = np.ascontiguousarray(eamc.entries().reshape(len(eamc), -1))
    _, exact = faiss.knn(xq, xb, k, metric=faiss.METRIC_INNER_PRODUCT)
    _, got = eamc.search(queries, k)
    hits = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(exact, got, strict=True)]
    return float(np.mean(hits) / k)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result dict (settings + figures)."""
    eamc = EAMC(
        args.layers, args.experts, capacity=args.capacity, index=args.index, threads=args.threads,
        nlist=args.nlist, nprobe=args.nprobe,
    )  # fmt: skip
    synth = {"groups": args.groups, "noise": args.noise}
    fill_s = fill(eamc, args.seed, **synth)
    pool = synthetic_eams(_POOL, args.layers, args.experts, seed=args.seed, request_seed=1, **synth)
    pool = pool.astype(np.float32)
    result: dict[str, Any] = {
        "settings": {
            "layers": args.layers, "experts": args.experts, "dim": args.layers * args.experts,
            "capacity": args.capacity, "entries": len(eamc), "k": args.k, "index": args.index,
            "threads": args.threads, "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
            "faiss": faiss.__version__, "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "data": f"synthetic EAMs (groups={args.groups} noise={args.noise}), full-row queries",
            "loadavg_1m": round(os.getloadavg()[0], 2),
        },
        "fill_seconds": round(fill_s, 3),
    }  # fmt: skip
    if args.index == "ivf":
        ivf = eamc._ivf
        assert ivf is not None
        result["settings"].update(nlist=ivf.nlist, nprobe=ivf.nprobe, trained=ivf.trained)
    for batch in (1, 16):
        batches = [pool[(i * batch) % _POOL : (i * batch) % _POOL + batch] for i in range(_POOL // batch)]
        state = {"i": 0}

        def one(batches: list[np.ndarray] = batches, state: dict[str, int] = state) -> None:
            state["i"] += 1
            eamc.search(batches[state["i"] % len(batches)], args.k)

        med, p90 = _median_us(one, args.iters, args.warmup)
        result[f"batch{batch}"] = {
            "median_us": round(med, 1),
            "p90_us": round(p90, 1),
            "per_query_us": round(med / batch, 1),
        }
        if args.index == "flat":
            steps = max(10, args.iters // args.layers)
            result[f"prefix_batch{batch}"] = prefix_step(eamc, pool, batch, args.k, steps, args.seed)
    state = {"i": 0}

    def add_one() -> None:
        state["i"] += 1
        eamc.add(pool[state["i"] % _POOL])

    med, p90 = _median_us(add_one, max(20, args.iters // 5), max(5, args.warmup // 5))
    result["add_full"] = {"median_us": round(med, 1), "p90_us": round(p90, 1)}
    if args.index == "ivf":
        result[f"recall_at_{args.k}"] = round(recall_at_k(eamc, pool, args.k), 4)
        result["recall_at_1"] = round(recall_at_k(eamc, pool, 1), 4)
    if args.capacity in PAPER_US:
        result["paper_us_per_query"] = PAPER_US[args.capacity]
    return result


def _print(result: dict[str, Any]) -> None:
    from richconsole import Table, make_console

    s = result["settings"]
    console = make_console()
    console.print(
        "EAMC search  " + "  ".join(f"{k}={v}" for k, v in s.items()) + f"  fill={result['fill_seconds']}s"
    )
    table = Table("what", "median us", "p90 us", "per query us")
    for batch in (1, 16):
        r = result[f"batch{batch}"]
        table.add_row(
            f"search, batch {batch}",
            f"{r['median_us']:.1f}",
            f"{r['p90_us']:.1f}",
            f"{r['per_query_us']:.1f}",
        )
    a = result["add_full"]
    table.add_row("add (full: replace most similar)", f"{a['median_us']:.1f}", f"{a['p90_us']:.1f}", "")
    for batch in (1, 16):
        r = result.get(f"prefix_batch{batch}")
        if r:
            per_q = f"{r['per_layer_us'] / batch:.1f}"
            table.add_row(
                f"PrefixMatcher.begin_step, batch {batch}", f"{r['begin_step_median_us']:.1f}", "", ""
            )
            table.add_row(f"PrefixMatcher.update, batch {batch}", f"{r['update_median_us']:.1f}", "", "")
            table.add_row(
                f"  per layer incl. begin_step/L, batch {batch}", f"{r['per_layer_us']:.1f}", "", per_q
            )
    console.print(table)
    for key in ("recall_at_1", f"recall_at_{s['k']}", "paper_us_per_query"):
        if key in result:
            console.print(f"{key}: {result[key]}")


def _cmd(args: argparse.Namespace) -> int:
    if args.capacities is not None:
        from moe_runtime.errors import ConfigError
        from moeserve.bench.eamc_capacity import render_capacities, run_capacities

        if args.repeats < 3:
            raise ConfigError(f"--repeats {args.repeats}: must be >= 3 (median and spread)")
        result = run_capacities(args)
        print(json.dumps(result, indent=2) if args.json else render_capacities(result))
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _capacities(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers expected") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every capacity must be >= 1")
    return values


def register_bench(benches: argparse._SubParsersAction) -> None:
    """Add ``eamc`` to the ``moeserve bench`` group."""
    p = benches.add_parser("eamc", help="EAMC query latency (and IVF recall)", description=__doc__)
    p.add_argument("--capacity", type=int, default=1000, help="EAMC entries (filled to capacity)")
    p.add_argument("--layers", type=int, default=32, help="MoE layers L")
    p.add_argument("--experts", type=int, default=8, help="experts per layer E")
    p.add_argument("--k", type=int, default=4, help="matches per query")
    p.add_argument("--index", choices=("flat", "ivf"), default="flat")
    p.add_argument("--nlist", type=int, default=None, help="IVF cells (default sqrt(capacity))")
    p.add_argument("--nprobe", type=int, default=None, help="IVF cells probed (default nlist/8)")
    p.add_argument("--threads", type=int, default=1, help="faiss OpenMP threads per search")
    p.add_argument("--iters", type=int, default=500, help="timed searches per batch size")
    p.add_argument("--warmup", type=int, default=50, help="untimed searches first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=64, help="activation patterns of the synthetic EAMs")
    p.add_argument(
        "--noise", type=float, default=0.3, help="per-request share of the synthetic EAMs in [0, 1]"
    )
    p.add_argument(
        "--capacities",
        type=_capacities,
        default=None,
        help="comma-separated capacities: prediction precision (--traces) against matching cost per "
        "capacity instead of the query latency (moeserve.bench.eamc_capacity)",
    )
    p.add_argument(
        "--traces",
        nargs=2,
        action="append",
        metavar=("WARM", "EVAL"),
        help="with --capacities: trace files (moeserve trace record) of one workload; repeatable",
    )
    p.add_argument("--batch", type=int, default=16, help="with --capacities: the matcher's batch")
    p.add_argument(
        "--repeats", type=int, default=5, help="with --capacities: timed matcher calls, >= 3 (default: 5)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd)
