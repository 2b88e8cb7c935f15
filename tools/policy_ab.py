"""Paired A/B of policies on the runtime, batch by batch: is one policy slower than another by a
percent or two?

``moeserve bench policies`` runs each policy over the whole workload per round, so a round's
ratio carries the host's drift over a run (its rounds' ratios spread by 5-10% on the shared
2-core development host), and three rounds cannot resolve the 2% of issue #15's "never slower
than on-demand + LRU beyond noise". Here one engine per policy is built and warmed on the warm
prompts, then every batch of the eval prompts is decoded by each engine in turn (the order
alternating from batch to batch), repeated ``--repeats`` times: each batch gives one ratio per
policy against the first, taken under the same load moments apart, and the median over all of
them resolves about 1% with a few hundred decode steps per policy.

A policy is a row label of ``bench policies`` (``COMBOS``), or ``eam@<arm>``: the default ``eam``
row held in one arm of its measured trial (``EAMPrefetch.pin``; ``prefetch``, ``cache`` or
``lean``), which splits what the default costs into what its arms cost and what its trial's
exploring and switching cost.

Prints the settings and, per policy, the median TPOT and the median, mean and quartiles of the
paired ratios; ``--json`` prints them as JSON::

    python tools/policy_ab.py --policies on-demand+lru,on-demand+eam-reuse,eam --fraction 0.5 --batch 1 --link-gbps 0
    python tools/policy_ab.py --policies on-demand+lru,eam,eam@cache,eam@lean --fraction 0.1 --batch 4 --link-gbps 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_runtime.prefetch.trial import MODES  # noqa: E402
from moeserve.bench.policies import COMBOS, _run_batches, load_model_and_workload  # noqa: E402


def parse_policy(label: str) -> tuple[str, str, dict, str | None]:
    """``(prefetch policy, cache policy, runtime overrides, pinned arm or None)`` of a label: a
    ``bench policies`` row but the oracle, or ``eam@<arm>`` (``arm`` one of ``MODES``).

    Raises:
        ValueError: an unknown label.
    """
    known = {c[0]: c for c in COMBOS if c[0] != "oracle"}
    base, _, arm = label.partition("@")
    if base not in known or (arm and (base != "eam" or arm not in MODES)):
        pinned = ", ".join(f"eam@{m}" for m in MODES)
        raise ValueError(f"unknown or unpaired policy {label!r} (one of {sorted(known)}, or {pinned})")
    _, prefetch, cache, overrides = known[base]
    return prefetch, cache, overrides, arm or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p, policies="on-demand+lru,eam", fraction=0.25, batch=1)
    p.add_argument("--repeats", type=int, default=6, help="passes over the eval batches (>= 3)")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error(f"--repeats {args.repeats}: must be >= 3")
    labels, specs = parse_policies(p, args)
    from moeserve.commands.common import resolve_model

    model_dir = resolve_model(args)
    base, loaded, warm, evals, tasks = load_workload(args)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    engines = []
    try:
        for spec in specs:
            engine = build_engine(loaded, base, args.fraction, spec)
            engines.append(engine)
            _run_batches(engine, warm, args.batch, args.new_tokens)  # warm-up: EAMC, caches, trial
        tpots: dict[str, list[float]] = {label: [] for label in labels}
        outputs: dict[str, list] = {label: [] for label in labels}
        for rep in range(args.repeats):
            for n, i in enumerate(range(0, len(evals), args.batch)):
                chunk = evals[i : i + args.batch]
                order = list(range(len(labels)))
                if (rep + n) % 2:
                    order.reverse()
                for j in order:
                    tp, out = _run_batches(engines[j], chunk, args.batch, args.new_tokens)
                    tpots[labels[j]].append(tp[0])
                    outputs[labels[j]].append(out)
    finally:
        for engine in engines:
            engine.close()
    for label in labels[1:]:
        if outputs[label] != outputs[labels[0]]:
            print(f"policy_ab: {label} changed the outputs", file=sys.stderr)
            return 1
    ref = tpots[labels[0]]
    rows = []
    for label in labels:
        ratios = [a / b for a, b in zip(tpots[label], ref)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        rows.append(
            {
                "policy": label,
                "tpot_ms_median": statistics.median(tpots[label]) * 1e3,
                "ratio_median": statistics.median(ratios),
                "ratio_mean": statistics.mean(ratios),
                "ratio_q1": q1,
                "ratio_q3": q3,
                "pairs": len(ratios),
            }
        )
    settings = {
        "model": model_dir.name,
        "policies": labels,
        "reference": labels[0],
        "buffer_fraction": args.fraction,
        "batch": args.batch,
        "link_gbps": args.link_gbps or None,
        "tasks": tasks,
        "eval_prompts": len(evals),
        "warm_prompts": len(warm),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "warmup": "each engine decodes the warm prompts first, not timed",
        "order": "per eval batch every policy once, the order alternating",
        "cpu_threads": 1,
        "dtype": "fp32",
        "load_avg_before": load_before,
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}, indent=2))
        return 0
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"TPOT per eval batch, paired against {labels[0]}: median ratio, mean, quartiles")
    for r in rows:
        print(
            f"  {r['policy']:22s} TPOT {r['tpot_ms_median']:6.2f} ms  ratio {r['ratio_median']:.3f}  "
            f"mean {r['ratio_mean']:.3f}  [{r['ratio_q1']:.3f}, {r['ratio_q3']:.3f}]  pairs {r['pairs']}"
        )
    return 0


def add_workload_args(p: argparse.ArgumentParser, policies: str, fraction: float, batch: int) -> None:
    """The flags of a runtime A/B on the bundled model's ``bench policies`` workload (shared with
    ``tools/expert_layout.py``): the model, prompts, policies, buffer, batch, emulated link and
    workload sizes, ``--json``."""
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--prompts", type=Path, default=ROOT.parent / "shared/data/prompts/prompts_combined.jsonl")
    p.add_argument("--policies", default=policies, help="the first is the reference")
    p.add_argument("--fraction", type=float, default=fraction, help="buffer size, share of all experts")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--link-gbps", type=float, default=0.0, help="emulated link, GB/s (0: none)")
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--warm", type=int, default=2, help="warm prompts per task")
    p.add_argument("--eval", type=int, default=2, help="eval prompts per task")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def parse_policies(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[tuple]]:
    """``(labels, specs)`` of ``--policies`` (:func:`parse_policy` each); an unknown label is a
    parser error."""
    labels = args.policies.split(",")
    try:
        return labels, [parse_policy(label) for label in labels]
    except ValueError as e:
        p.error(f"--policies: {e}")
        raise  # p.error exits


def load_workload(args: argparse.Namespace) -> tuple:
    """``(base RuntimeConfig, loaded model, warm prompts, eval prompts, tasks)`` for ``args``
    (:func:`add_workload_args`): fp32, one CPU thread, the emulated link as given."""
    import torch

    from moe_runtime.config import RuntimeConfig
    from moeserve.commands.common import resolve_model

    torch.set_num_threads(1)
    args.dtype, args.cpu_threads = "fp32", 1
    base = RuntimeConfig(
        dtype="fp32",
        max_batch_size=args.batch,
        cpu_threads=1,
        link_gbps=args.link_gbps or None,
        link_latency_us=args.link_latency_us,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
    )
    loaded, warm, evals, tasks = load_model_and_workload(resolve_model(args), base, args, "policies")
    return base, loaded, warm, evals, tasks


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


if __name__ == "__main__":
    raise SystemExit(main())
