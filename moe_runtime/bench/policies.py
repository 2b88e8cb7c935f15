"""``moeserve bench policies``: every prefetch/cache policy on the real runtime (MoE-Infinity Tables 2, 3, 5).

Workload: task-labelled prompts (default ``../shared/data/prompts/prompts_combined.jsonl``) from
``--tasks`` tasks; per task, ``--warm`` prompts fill the EAMC and warm the learned baselines
(model counts, hot-expert tables) and a disjoint ``--eval`` prompts are measured. Each eval batch
of ``--batch`` requests generates ``--new-tokens`` greedy tokens. For every buffer size and policy
the same warm-then-eval sequence runs on a fresh buffer with the emulated link (plus one run with
every expert resident, the reference for TPOT); the oracle replays
the expert-access log recorded during the on-demand run's eval part (outputs, hence accesses, are
identical across policies — the run checks it). Reported per policy: buffer hit rate, blocking
time per token, bytes moved per token, TPOT (median over eval batches of the mean decode-step time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from moe_runtime.bench.prompts import prompts_by_task

COMBOS = [  # (label, prefetch policy, cache policy, runtime overrides)
    ("on-demand+lru", "on-demand", "lru", {}),
    ("next-layer-all+lru", "next-layer-all", "lru", {}),
    ("model-counts", "model-counts", "model-counts", {}),
    ("hot-experts+lru", "hot-experts", "lru", {}),
    ("eam-paper", "eam", "eam", {"router_lookahead": 0}),  # MoE-Infinity's EAMC-only plan
    ("eam", "eam", "eam-reuse", {}),  # the default: EAMC + router lookahead, cost-aware; loop-aware cache
    ("on-demand+eam-reuse", "on-demand", "eam-reuse", {}),  # caching alone, loop-aware
    ("oracle", "oracle", "oracle", {}),
]


@dataclass
class PolicyResult:
    buffer_fraction: float
    buffer_slots: int
    policy: str
    hit_rate: float
    blocking_ms_per_token: float
    bytes_per_token: float
    tpot_ms: float
    prefetch_issued: int
    prefetch_landed: int  # prefetches that completed a copy into a slot
    prefetch_used: int
    tokens: int
    gap_closed: float | None = None  # share of the on-demand+lru -> oracle TPOT gap closed
    bytes_vs_oracle: float | None = None  # bytes moved per token / the oracle's


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser("policies", help="hit rate, blocking time, bytes and TPOT per prefetch/cache policy")
    add_model_arg(p)
    register_workload_args(p)
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="buffer sizes as shares of all experts")
    p.add_argument("--policies", default=",".join(c[0] for c in COMBOS))
    p.add_argument("--link-gbps", type=float, default=0.5, help="emulated link, GB/s (default: 0.5)")
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument(
        "--prefetch-depth", type=int, default=None, help="later layers a plan covers (default: all)"
    )
    p.add_argument(
        "--router-lookahead", type=int, default=1, help="router lookahead layers of the eam row (default: 1)"
    )
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def register_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags shared by ``bench policies`` and ``bench lookahead``."""
    default_prompts = (
        Path(__file__).resolve().parents[2].parent / "shared/data/prompts/prompts_combined.jsonl"
    )
    p.add_argument("--prompts", type=Path, default=default_prompts, help="JSONL of {dataset, task, prompt}")
    p.add_argument("--tasks", type=int, default=6, help="tasks drawn from the prompt file")
    p.add_argument("--warm", type=int, default=4, help="prompts per task that warm the EAMC / counts")
    p.add_argument("--eval", type=int, default=2, help="prompts per task measured (disjoint from warm)")
    p.add_argument("--batch", type=int, default=4, help="requests decoded together")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)


def load_model_and_workload(model_dir: Path, runtime, args: argparse.Namespace, bench: str):
    """Load the checkpoint and draw the warm/eval prompts of ``args`` (the workload flags).

    Returns ``(loaded, warm ids, eval ids, tasks)``. Raises ConfigError when the checkpoint has
    no tokenizer (the prompts are text).
    """
    from moe_runtime.errors import ConfigError
    from moe_runtime.loader import load_checkpoint

    loaded = load_checkpoint(model_dir, runtime)
    if loaded.tokenizer is None:
        raise ConfigError(f"{model_dir}: the {bench} benchmark needs a tokenizer")
    warm, evals, tasks = load_workload(
        args.prompts, loaded.tokenizer, args.tasks, args.warm, args.eval, args.max_prompt_tokens, args.seed
    )
    return loaded, warm, evals, tasks


def load_workload(
    path: Path, tokenizer, tasks: int, warm: int, evals: int, max_tokens: int, seed: int
) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Warm and eval prompt token ids (disjoint), drawn from ``tasks`` random tasks with enough prompts."""
    by_task = prompts_by_task(path)
    rng = random.Random(seed)
    eligible = sorted(t for t, ps in by_task.items() if len(ps) >= warm + evals)
    chosen = rng.sample(eligible, min(tasks, len(eligible)))
    warm_ids, eval_ids = [], []
    for task in chosen:
        prompts = rng.sample(by_task[task], warm + evals)
        ids = [tokenizer.encode(p)[:max_tokens] or [0] for p in prompts]
        warm_ids += ids[:warm]
        eval_ids += ids[warm:]
    return warm_ids, eval_ids, chosen


def _run_batches(engine, prompts: list[list[int]], batch: int, new_tokens: int) -> tuple[list[float], list]:
    """Decode ``prompts`` in batches; returns per-batch TPOT (s) and the outputs."""
    from moe_runtime.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    tpots, outputs = [], []
    for i in range(0, len(prompts), batch):
        for j, p in enumerate(prompts[i : i + batch]):
            engine.add_request(f"b{i}-{j}-{time.monotonic_ns()}", p, params)
        engine.step()  # prefill + first token
        steps = []
        done = {}
        while engine.has_unfinished():
            t0 = time.perf_counter()
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.output_token_ids
            steps.append(time.perf_counter() - t0)
        tpots.append(sum(steps) / max(1, len(steps)))
        outputs += [done[k] for k in sorted(done)]
    return tpots, outputs


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.errors import ConfigError
    from moe_runtime.prefetch import OracleSchedule
    from moeserve.commands.common import resolve_model

    torch.set_num_threads(args.cpu_threads)
    model_dir = resolve_model(args)
    labels = args.policies.split(",")
    combos = [c for c in COMBOS if c[0] in labels]
    if "oracle" in labels and "on-demand+lru" not in labels:
        combos.insert(0, COMBOS[0])  # the oracle replays the on-demand run's accesses
    base = RuntimeConfig(
        dtype=args.dtype,
        max_batch_size=args.batch,
        cpu_threads=args.cpu_threads,
        link_gbps=args.link_gbps,
        link_latency_us=args.link_latency_us,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
        prefetch_depth=args.prefetch_depth,
        router_lookahead=args.router_lookahead,
    )
    loaded, warm, evals, tasks = load_model_and_workload(model_dir, base, args, "policies")
    cfg = loaded.config
    results: list[PolicyResult] = []
    reference = None  # every run, whatever the buffer or policy, must produce these tokens
    runs = [(1.0, [("all-resident", "on-demand", "lru", {})])]
    runs += [(float(f), combos) for f in args.fractions.split(",")]
    for fraction, fraction_combos in runs:
        log = None
        for label, prefetch, cache, overrides in fraction_combos:
            rt = RuntimeConfig(
                **{
                    **{f.name: getattr(base, f.name) for f in fields(base)},
                    "buffer_fraction": fraction,
                    "prefetch_policy": prefetch,
                    "cache_policy": cache,
                    **overrides,
                }
            )
            context = {"oracle": OracleSchedule(log, cfg.num_experts)} if prefetch == "oracle" else None
            with LLMEngine(loaded, rt, policy_context=context) as engine:
                if prefetch != "oracle":
                    _run_batches(engine, warm, args.batch, args.new_tokens)
                if prefetch == "on-demand":
                    engine.buffer.access_log = []
                st0 = engine.buffer.stats.snapshot()
                tpots, outputs = _run_batches(engine, evals, args.batch, args.new_tokens)
                st1 = engine.buffer.stats
                if prefetch == "on-demand":
                    log = engine.buffer.access_log
                if reference is None:
                    reference = outputs
                elif outputs != reference:
                    raise ConfigError(f"policy {label} changed the outputs (it must not)")
                tokens = sum(len(o) for o in outputs)
                lookups = st1.total_lookups - st0.total_lookups
                moved = st1.demand_bytes + st1.prefetch_bytes - st0.demand_bytes - st0.prefetch_bytes
                res = PolicyResult(
                    fraction,
                    engine.buffer.num_slots,
                    label,
                    (st1.total_hits - st0.total_hits) / lookups if lookups else 0.0,
                    1e3 * (st1.total_blocking_s - st0.total_blocking_s) / tokens,
                    moved / tokens,
                    1e3 * statistics.median(tpots),
                    st1.prefetch_issued - st0.prefetch_issued,
                    (st1.prefetch_bytes - st0.prefetch_bytes) // loaded.store.expert_nbytes,
                    st1.prefetch_used - st0.prefetch_used,
                    tokens,
                )
                results.append(res)
                if not args.json:
                    print(
                        f"  {fraction:.0%} {label}: hit={res.hit_rate:.3f} tpot={res.tpot_ms:.2f} ms",
                        file=sys.stderr,
                    )
    settings = {
        "model": str(model_dir),
        "architecture": cfg.architecture,
        "experts": cfg.num_moe_layers * cfg.num_experts,
        "expert_bytes": loaded.store.expert_nbytes,
        "dtype": args.dtype,
        "device": "cpu",
        "cpu_threads": args.cpu_threads,
        "link_gbps": args.link_gbps,
        "link_latency_us": args.link_latency_us,
        "tasks": tasks,
        "warm_prompts": len(warm),
        "eval_prompts": len(evals),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "router_lookahead": args.router_lookahead,
        "seed": args.seed,
    }
    from moe_runtime.sim.report import add_relative

    add_relative(results, group="buffer_fraction")
    if args.json:
        print(json.dumps({"settings": settings, "results": [asdict(r) for r in results]}, indent=2))
    else:
        print_tables(settings, results)
    return 0


def print_tables(settings: dict, results: list[PolicyResult]) -> None:
    """Paper-style tables: blocking and bytes normalised to on-demand; hit rate vs. oracle."""
    from richconsole import Table, make_console

    console = make_console()
    table = Table(title="moeserve bench policies")
    for col in (
        "buffer",
        "policy",
        "hit rate",
        "vs oracle",
        "block ms/tok",
        "block vs on-demand",
        "KiB/tok",
        "bytes vs on-demand",
        "TPOT ms",
        "gap closed",
        "bytes vs oracle",
    ):
        table.add_column(col, justify="right")
    for fraction in sorted({r.buffer_fraction for r in results}):
        rows = [r for r in results if r.buffer_fraction == fraction]
        base = next((r for r in rows if r.policy == "on-demand+lru"), None)
        oracle = next((r for r in rows if r.policy == "oracle"), None)
        for r in rows:
            table.add_row(
                f"{fraction:.0%}",
                r.policy,
                f"{r.hit_rate:.3f}",
                f"{r.hit_rate - oracle.hit_rate:+.3f}" if oracle else "",
                f"{r.blocking_ms_per_token:.2f}",
                f"{r.blocking_ms_per_token / base.blocking_ms_per_token:.2f}"
                if base and base.blocking_ms_per_token
                else "",
                f"{r.bytes_per_token / 1024:.0f}",
                f"{r.bytes_per_token / base.bytes_per_token:.2f}" if base and base.bytes_per_token else "",
                f"{r.tpot_ms:.2f}",
                f"{100 * r.gap_closed:.0f}%" if r.gap_closed is not None else "",
                f"{r.bytes_vs_oracle:.2f}x" if r.bytes_vs_oracle is not None else "",
            )
    console.print(table)
    console.print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
