"""``moeserve bench ab``: policies paired batch by batch on the runtime, resolving about 1% of TPOT.

``bench policies`` runs each policy over the whole workload per round, so a round's ratio carries
the host's drift over a run (on a shared 2-core host its rounds' ratios spread by 5-10%). Here one
engine per policy is built and warmed on the warm prompts (not timed), then every batch of the eval
prompts is decoded by each engine in turn (the order alternating from batch to batch), over
``--repeats`` passes: each batch gives one ratio per policy against the first, taken under the
same load moments apart, and the median over all of them resolves about 1% with a few hundred
decode steps per policy.

A policy is a row label of ``bench policies`` (``COMBOS``, the oracle excepted), or ``eam@<arm>``:
the default ``eam`` row held in one arm of its measured trial (``EAMPrefetch.pin``; ``prefetch``,
``cache`` or ``lean``), which splits what the default costs into what its arms cost and what its
trial's exploring and switching cost. Per policy: the median TPOT with the spread of the passes'
medians, and the median, mean, quartiles and per-pass spread of the paired ratios::

    moeserve bench ab --policies on-demand+lru,on-demand+eam-reuse,eam --fraction 0.5 --batch 1
    moeserve bench ab --policies on-demand+lru,eam,eam@cache,eam@lean --fraction 0.1 --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

from moe_runtime.prefetch.trial import MODES


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.bench.policies import register_workload_args
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser(
        "ab", help="policies paired batch by batch: TPOT ratios against the first, to about 1 percent"
    )
    add_model_arg(p)
    register_workload_args(p)
    p.set_defaults(tasks=8, warm=2, eval=2, batch=1, new_tokens=16)
    p.add_argument(
        "--policies",
        default="on-demand+lru,eam",
        help="bench policies rows or eam@<arm>; the first is the reference (default: on-demand+lru,eam)",
    )
    p.add_argument("--fraction", type=float, default=0.25, help="buffer size, share of all experts")
    p.add_argument("--link-gbps", type=float, default=0.0, help="emulated link, GB/s (default: 0, none)")
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=6, help="passes over the eval batches, >= 3 (default: 6)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def parse_policy(label: str) -> tuple[str, str, dict, str | None]:
    """``(prefetch policy, cache policy, runtime overrides, pinned arm or None)`` of a label: a
    ``bench policies`` row but the oracle, or ``eam@<arm>`` (``arm`` one of ``MODES``).

    Raises:
        ValueError: an unknown label.
    """
    from moeserve.bench.policies import COMBOS

    known = {c[0]: c for c in COMBOS if c[0] != "oracle"}
    base, _, arm = label.partition("@")
    if base not in known or (arm and (base != "eam" or arm not in MODES)):
        pinned = ", ".join(f"eam@{m}" for m in MODES)
        raise ValueError(f"unknown or unpaired policy {label!r} (one of {sorted(known)}, or {pinned})")
    _, prefetch, cache, overrides = known[base]
    return prefetch, cache, overrides, arm or None


def build_engine(loaded, base, fraction: float, spec: tuple):  # type: ignore[no-untyped-def]
    """An ``LLMEngine`` of policy ``spec`` (:func:`parse_policy`) at buffer ``fraction``, its
    ``eam`` arm pinned when the label named one."""
    from moe_runtime.engine.engine import LLMEngine

    prefetch, cache, overrides, arm = spec
    rt = replace(base, buffer_fraction=fraction, prefetch_policy=prefetch, cache_policy=cache, **overrides)
    engine = LLMEngine(loaded, rt)
    if arm is not None:
        engine.prefetcher.pin(arm)
    return engine


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarise(labels: list[str], tpots: dict[str, list[list[float]]]) -> list[dict]:
    """Per policy, from its TPOT per eval batch per pass (``tpots[label][pass][batch]``, s): the
    median TPOT (ms) with the spread of the passes' medians, and the ratios paired batch by batch
    against ``labels[0]``: median, mean, quartiles, and the spread of the passes' median ratios."""
    ref = tpots[labels[0]]
    rows = []
    for label in labels:
        per_pass = [[a / b for a, b in zip(got, want)] for got, want in zip(tpots[label], ref)]
        ratios = [r for one in per_pass for r in one]
        flat = [t for one in tpots[label] for t in one]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        tpot = _spread([statistics.median(one) * 1e3 for one in tpots[label]])
        ratio = _spread([statistics.median(one) for one in per_pass])
        rows.append(
            {
                "policy": label,
                "tpot_ms_median": statistics.median(flat) * 1e3,
                "tpot_ms_pass_min": tpot[1],
                "tpot_ms_pass_max": tpot[2],
                "ratio_median": statistics.median(ratios),
                "ratio_mean": statistics.mean(ratios),
                "ratio_q1": q1,
                "ratio_q3": q3,
                "ratio_pass_min": ratio[1],
                "ratio_pass_max": ratio[2],
                "pairs": len(ratios),
            }
        )
    return rows


def measure(args: argparse.Namespace, labels: list[str], specs: list[tuple]) -> tuple[dict, list[dict]]:
    """The settings and rows of one A/B run. Raises ConfigError when a policy changed the outputs."""
    import torch

    from moe_runtime.config import RuntimeConfig
    from moe_runtime.errors import ConfigError
    from moeserve.bench.policies import _run_batches, load_model_and_workload
    from moeserve.commands.common import resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model(args)
    base = RuntimeConfig(
        dtype="fp32",
        max_batch_size=args.batch,
        cpu_threads=1,
        link_gbps=args.link_gbps or None,
        link_latency_us=args.link_latency_us,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
        expert_compute="device",  # the copy policies compared: every miss copied (bench hybrid: the modes)
    )
    loaded, warm, evals, tasks = load_model_and_workload(model_dir, base, args, "ab")
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    engines = []
    tpots: dict[str, list[list[float]]] = {label: [] for label in labels}
    outputs: dict[str, list] = {label: [] for label in labels}
    try:
        for spec in specs:
            engines.append(build_engine(loaded, base, args.fraction, spec))
            _run_batches(engines[-1], warm, args.batch, args.new_tokens)  # warm-up: EAMC, caches, trial
        for rep in range(args.repeats):
            for label in labels:
                tpots[label].append([])
            for n, i in enumerate(range(0, len(evals), args.batch)):
                chunk = evals[i : i + args.batch]
                order = list(range(len(labels)))
                if (rep + n) % 2:
                    order.reverse()
                for j in order:
                    tp, out = _run_batches(engines[j], chunk, args.batch, args.new_tokens)
                    tpots[labels[j]][-1].append(tp[0])
                    outputs[labels[j]].append(out)
    finally:
        for engine in engines:
            engine.close()
    for label in labels[1:]:
        if outputs[label] != outputs[labels[0]]:
            raise ConfigError(f"policy {label} changed the outputs (it must not)")
    settings = {
        "model": model_dir.name,
        "policies": labels,
        "reference": labels[0],
        "buffer_fraction": args.fraction,
        "batch": args.batch,
        "link_gbps": args.link_gbps or None,
        "link_latency_us": args.link_latency_us,
        "tasks": tasks,
        "eval_prompts": len(evals),
        "warm_prompts": len(warm),
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "seed": args.seed,
        "repeats": args.repeats,
        "warmup": "each engine decodes the warm prompts first, not timed",
        "order": "per eval batch every policy once, the order alternating",
        "cpu_threads": 1,
        "dtype": "fp32",
        "device": "cpu",
        "load_avg_before": load_before,
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    return settings, summarise(labels, tpots)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError

    if args.repeats < 3:
        raise ConfigError(f"--repeats {args.repeats}: must be >= 3 (median and spread of passes)")
    labels = args.policies.split(",")
    try:
        specs = [parse_policy(label) for label in labels]
    except ValueError as exc:
        raise ConfigError(f"--policies: {exc}") from None
    settings, rows = measure(args, labels, specs)
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}, indent=2))
        return 0
    print(f"TPOT per eval batch, paired against {labels[0]}: median ratio, mean, quartiles, passes' spread")
    for r in rows:
        print(
            f"  {r['policy']:22s} TPOT {r['tpot_ms_median']:6.2f} ms "
            f"[{r['tpot_ms_pass_min']:.2f}-{r['tpot_ms_pass_max']:.2f}]  ratio {r['ratio_median']:.3f}  "
            f"mean {r['ratio_mean']:.3f}  quartiles [{r['ratio_q1']:.3f}, {r['ratio_q3']:.3f}]  "
            f"passes [{r['ratio_pass_min']:.3f}, {r['ratio_pass_max']:.3f}]  pairs {r['pairs']}"
        )
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return 0
