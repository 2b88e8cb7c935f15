"""The memory plan's split against fixed buffer fractions at the same device memory.

On the bundled model with an emulated link, ``--device-memory`` is set to what the dense weights,
the activations of a step, the KV cache of the batch at ``--max-model-len`` and ``--share`` of the
experts take (0.3: offloading is forced). Rows: ``plan`` (no memory flag: the plan splits) and one
per ``--fractions`` value (``--buffer-fraction F``: the KV cache takes the rest, at most the batch at
``--max-model-len``). Each row is a fresh engine on the same loaded model: ``bench policies``'
workload (task-labelled prompts, ``--warm`` prompts per task through the engine first, then the
``--eval`` ones timed in batches of ``--batch`` greedy requests), its TPOT (median over eval batches
of the mean decode-step time) and decode throughput (eval tokens over the eval wall time), the
buffer hit rate and the preemptions. One warm-up round, then ``--repeats`` rounds, every row once
per round (round-robin, each round starting one row later, so drift and order hit every row alike);
median and [min-max] over the rounds.

    moeserve bench memory-split --repeats 3 [--json]
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

import torch

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.loader import load_checkpoint, read_model_config
from moe_runtime.memory_plan import human_bytes, plan_memory
from moe_runtime.paths import shown_path
from moeserve.bench.policies import _run_batches, load_workload
from moeserve.commands.common import add_model_arg, resolve_model


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory-split", help="the memory plan's KV/slot split against fixed buffer fractions (same memory)"
    )
    default_prompts = (
        Path(__file__).resolve().parents[2].parent / "shared/data/prompts/prompts_combined.jsonl"
    )
    add_model_arg(p)
    p.add_argument("--prompts", type=Path, default=default_prompts)
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--eval", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share", type=float, default=0.3, help="experts the device memory holds beside the rest")
    p.add_argument(
        "--fractions", default="0.05,0.1,0.2,0.3,0.32", help="fixed --buffer-fraction splits (each must fit)"
    )
    p.add_argument("--link-gbps", type=float, default=0.5)
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the settings and rows as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    model_dir = resolve_model(args)
    base = RuntimeConfig(
        max_batch_size=args.batch,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
        max_num_batched_tokens=args.batch * args.max_prompt_tokens,
        link_gbps=args.link_gbps,
        link_latency_us=args.link_latency_us,
        expert_compute="device",  # every miss copied, as bench policies compares the copy policies
        cpu_threads=1,
    )
    cfg = read_model_config(model_dir)[1]
    full = plan_memory(cfg, base)  # every expert resident, the batch's KV at --max-model-len
    total = full.dense + full.activations + full.kv_cache + int(args.share * full.expert_store)
    device_memory = int(total / base.gpu_memory_utilization) + 1
    base = replace(base, device_memory=device_memory)
    loaded = load_checkpoint(model_dir, base)
    warm, evals, _ = load_workload(
        args.prompts, loaded.tokenizer, args.tasks, args.warm, args.eval, args.max_prompt_tokens, args.seed
    )
    rows = [("plan", base)] + [
        (f"fraction {f}", replace(base, buffer_fraction=float(f))) for f in args.fractions.split(",")
    ]
    print(
        f"device memory {human_bytes(device_memory)} (budget {human_bytes(total)}), load {os.getloadavg()}",
        file=sys.stderr,
    )
    results: dict[str, list[dict]] = {label: [] for label, _ in rows}
    for rnd in range(args.repeats + 1):  # round 0: warm-up, not kept
        for label, rt in rows[rnd % len(rows) :] + rows[: rnd % len(rows)]:  # each round starts one later
            r = run_one(loaded, rt, warm, evals, args)
            if rnd:
                results[label].append(r)
            print(f"round {rnd} {label}: {r}", file=sys.stderr)
    settings = {
        "model": shown_path(model_dir),
        "device_memory": device_memory,
        "share": args.share,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "link_gbps": args.link_gbps,
        "link_latency_us": args.link_latency_us,
        "repeats": args.repeats,
        "warmup": "1 round of every row",
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    data = {"settings": settings, "rows": results}
    print(json.dumps(data, indent=1) if args.json else markdown(data))
    return 0


def run_one(loaded, rt: RuntimeConfig, warm, evals, args) -> dict:
    with LLMEngine(loaded, rt) as engine:
        _run_batches(engine, warm, args.batch, args.new_tokens)
        st0 = engine.buffer.stats.snapshot()
        pre0 = engine.scheduler.num_preemptions
        t0 = time.perf_counter()
        tpots, outputs = _run_batches(engine, evals, args.batch, args.new_tokens)
        wall = time.perf_counter() - t0
        st1 = engine.buffer.stats
        lookups = st1.total_lookups - st0.total_lookups
        return {
            "slots": engine.buffer.num_slots,
            "kv_blocks": engine.kv_manager.num_blocks,
            "tpot_ms": round(1e3 * statistics.median(tpots), 3),
            "tok_s": round(sum(len(o) for o in outputs) / wall, 1),
            "hit_rate": round((st1.total_hits - st0.total_hits) / lookups, 3) if lookups else 1.0,
            "preemptions": engine.scheduler.num_preemptions - pre0,
        }


def summarise(results: dict[str, list[dict]]) -> str:
    """A Markdown row per split: slots, KV blocks, and TPOT, decode tokens/s and hit rate as median
    [min-max] over the rounds."""

    def spread(rs: list[dict], key: str) -> str:
        v = [r[key] for r in rs]
        return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

    from moeserve.bench.render import md_table

    header = ["split", "slots", "KV blocks", "TPOT ms", "decode tok/s", "hit rate", "preemptions"]
    rows = [
        [label, str(rs[0]["slots"]), str(rs[0]["kv_blocks"]), spread(rs, "tpot_ms"), spread(rs, "tok_s"),
         spread(rs, "hit_rate"), str(max(r["preemptions"] for r in rs))]
        for label, rs in results.items()
    ]  # fmt: skip
    return md_table(header, rows)


def markdown(data: dict) -> str:
    """Markdown of ``bench memory-split --json`` (a generated docs block): a row per split, TPOT,
    decode tokens/s and hit rate as median [min-max] over the rounds, and the settings line."""
    settings = ", ".join(f"`{k}={v}`" for k, v in data["settings"].items())
    return summarise(data["rows"]) + f"\nSettings: {settings}\n"
