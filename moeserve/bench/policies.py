"""``moeserve bench policies``: every prefetch/cache policy on the real runtime (MoE-Infinity Tables 2, 3, 5).

Workload: task-labelled prompts (default ``../shared/data/prompts/prompts_combined.jsonl``) from
``--tasks`` tasks; per task, ``--warm`` prompts fill the EAMC and warm the learned baselines
(model counts, hot-expert tables) and a disjoint ``--eval`` prompts are measured. Each eval batch
of ``--batch`` requests generates ``--new-tokens`` greedy tokens. For every buffer size and policy
the same warm-then-eval sequence runs on a fresh buffer with the emulated link (plus one run with
every expert resident, the reference for TPOT); the oracle replays
the expert-access log recorded during the on-demand run's eval part (outputs, hence accesses, are
identical across policies — the run checks it). Reported per policy: buffer hit rate, blocking
time per token, bytes moved per token, TPOT (median over eval batches of the mean decode-step time),
and beside it the compute thread's CPU time and expert batches per decode step (what TPOT is made
of: ``TPOT - CPU`` is the step's waiting, for expert copies, locks or the GIL).

Every row runs ``--repeats`` (>= 3) times after one warm-up run, interleaved round-robin (each round
runs every row once, so slow drift of a shared host hits every policy alike); the report gives the
median and the spread (fastest and slowest repeat) of every figure, the ``eam`` vs on-demand+LRU
verdicts and the targets decided only when the spreads clear them
(:mod:`moeserve.bench.policy_summary`), and the host's load averages before and after.

Several ``--link-gbps`` or ``--batch`` values (comma-separated) run a grid: one such measurement
per (link, batch) point, one after another, all in one JSON (:mod:`moeserve.bench.policy_grid`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moeserve.bench.policy_grid import as_point, floats, ints, point_args, render_grid, run_grid
from moeserve.bench.policy_summary import PolicyRow, summarise, verdicts
from moeserve.bench.prompts import prompts_by_task

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
RESIDENT = ("all-resident", "on-demand", "lru", {})  # the TPOT reference, every expert in the buffer


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
    # eval decode steps the runtime's eam trial (moe_runtime.prefetch.trial.ModeTrial) ran with
    # prefetching on, as a share; None for the other policies
    prefetch_on_share: float | None = None
    # the same per arm of the trial (prefetch, cache, lean): {arm: share}; None without a trial
    arm_shares: dict[str, float] | None = None
    # compute-thread CPU ms per decode step and expert batches per decode step (DecodeTimes),
    # medians over the eval batches as TPOT is; None in results written before they existed
    cpu_ms: float | None = None
    expert_batches_per_step: float | None = None


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser("policies", help="hit rate, blocking time, bytes and TPOT per prefetch/cache policy")
    add_model_arg(p)
    register_workload_args(p, grid=True)
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="buffer sizes as shares of all experts")
    p.add_argument("--policies", default=",".join(c[0] for c in COMBOS))
    p.add_argument(
        "--link-gbps",
        type=floats,
        default=[0.5],
        help="emulated link, GB/s, comma-separated for a grid (default: 0.5; 0 = off)",
    )
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument(
        "--prefetch-depth", type=int, default=None, help="later layers a plan covers (default: all)"
    )
    p.add_argument(
        "--router-lookahead", type=int, default=1, help="router lookahead layers of the eam row (default: 1)"
    )
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs of every row, >= 3, round-robin (default: 3)"
    )
    p.add_argument(
        "--min-batches",
        type=int,
        default=0,
        help="raise warm and eval prompts per task to fill at least this many batches (default: 0, never)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def register_workload_args(p: argparse.ArgumentParser, grid: bool = False) -> None:
    """The workload flags shared by ``bench policies`` and ``bench lookahead`` (``grid``: ``--batch``
    takes comma-separated sizes, one grid point each)."""
    default_prompts = (
        Path(__file__).resolve().parents[2].parent / "shared/data/prompts/prompts_combined.jsonl"
    )
    p.add_argument("--prompts", type=Path, default=default_prompts, help="JSONL of {dataset, task, prompt}")
    p.add_argument("--tasks", type=int, default=6, help="tasks drawn from the prompt file")
    p.add_argument("--warm", type=int, default=4, help="prompts per task that warm the EAMC / counts")
    p.add_argument("--eval", type=int, default=2, help="prompts per task measured (disjoint from warm)")
    if grid:
        p.add_argument("--batch", type=ints, default=[4], help="requests decoded together, comma-separated")
    else:
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


@dataclass
class DecodeTimes:
    """Per eval batch of :func:`_run_batches` (beside its TPOT), the mean over its decode steps of:
    the compute thread's CPU time (``time.thread_time``, s: everything the step ran on it, its
    waits for expert copies, locks and the GIL excluded) and the expert batches the step ran
    (``ExpertStats.expert_batches``: the resident batch and each group of landed experts per MoE
    layer)."""

    cpu_s: list[float] = field(default_factory=list)
    expert_batches: list[float] = field(default_factory=list)


def _run_batches(
    engine, prompts: list[list[int]], batch: int, new_tokens: int, times: DecodeTimes | None = None
) -> tuple[list[float], list]:
    """Decode ``prompts`` in batches; returns per-batch TPOT (s) and the outputs. With ``times``,
    also appends each batch's figures there (the engine's steps run on this thread)."""
    from moe_runtime.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    counts = engine.buffer.stats.expert_batches
    tpots, outputs = [], []
    for i in range(0, len(prompts), batch):
        for j, p in enumerate(prompts[i : i + batch]):
            engine.add_request(f"b{i}-{j}-{time.monotonic_ns()}", p, params)
        engine.step()  # prefill + first token
        steps = []
        done = {}
        cpu, n0 = 0.0, sum(counts)
        while engine.has_unfinished():
            c0, t0 = time.thread_time(), time.perf_counter()
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.output_token_ids
            steps.append(time.perf_counter() - t0)
            cpu += time.thread_time() - c0
        n = max(1, len(steps))
        tpots.append(sum(steps) / n)
        if times is not None:
            times.cpu_s.append(cpu / n)
            times.expert_batches.append((sum(counts) - n0) / n)
        outputs += [done[k] for k in sorted(done)]
    return tpots, outputs


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError

    if args.repeats < 3:
        raise ConfigError(f"--repeats {args.repeats}: must be >= 3 (median and spread of runs)")
    if args.min_batches < 0:
        raise ConfigError(f"--min-batches {args.min_batches}: must be >= 0")
    if len(args.link_gbps) * len(args.batch) > 1:  # a grid: every point, one JSON
        data = run_grid(args, _point)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print_grid(data)
        return 0
    one = point_args(args, args.link_gbps[0], args.batch[0])
    if args.json:
        print(json.dumps(_point(one), indent=2))
    else:
        settings, rows, comparisons = _measured(one)
        print_tables(settings, rows, comparisons)
    return 0


def _measured(args: argparse.Namespace) -> tuple[dict, list[PolicyRow], list[dict]]:
    """One (link, batch) point: its settings, summarised rows and verdicts."""
    settings, rounds = measure(args, args.repeats)
    rows = summarise(rounds)
    return settings, rows, verdicts(rows)


def _point(args: argparse.Namespace) -> dict:
    """One point as its JSON: ``{"settings", "results", "verdicts"}``."""
    return as_point(*_measured(args))


def measure(
    args: argparse.Namespace, repeats: int, warmup: bool = True
) -> tuple[dict, list[list[PolicyResult]]]:
    """The settings and ``repeats`` rounds of the benchmark: after one warm-up run (all experts
    resident, not reported; skipped without ``warmup``), each round runs every row once, the
    all-resident reference first, then per buffer size every policy (on-demand+lru before the
    oracle, which replays its accesses). One engine per run, created in that order. Raises
    ConfigError for a checkpoint without a tokenizer or a policy that changes the outputs."""
    from moe_runtime.config import RuntimeConfig
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
        link_gbps=args.link_gbps or None,  # 0: no emulated link
        link_latency_us=args.link_latency_us,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
        expert_compute="device",  # the copy policies compared: every miss copied (bench hybrid: the modes)
        prefetch_depth=args.prefetch_depth,
        router_lookahead=args.router_lookahead,
    )
    loaded, warm, evals, tasks = load_model_and_workload(model_dir, base, args, "policies")
    cfg = loaded.config
    runs = [(1.0, [RESIDENT])] + [(float(f), combos) for f in args.fractions.split(",")]
    load_before = _load_average()
    t_start = time.monotonic()
    bench = _Runs(loaded, base, warm, evals, args)
    if warmup:
        bench.run_one(1.0, RESIDENT, None)  # warm-up, not reported
    rounds: list[list[PolicyResult]] = []
    for rep in range(repeats):  # round-robin: every row once per round, so drift hits all alike
        rounds.append([])
        for fraction, fraction_combos in runs:
            log = None
            for combo in fraction_combos:
                res, access_log = bench.run_one(fraction, combo, log)
                log = access_log if access_log is not None else log
                rounds[-1].append(res)
                if not args.json:
                    print(
                        f"  round {rep + 1}/{repeats} {fraction:.0%} {combo[0]}: "
                        f"hit={res.hit_rate:.3f} tpot={res.tpot_ms:.2f} ms",
                        file=sys.stderr,
                    )
    settings = {
        "model": model_dir.name,
        "architecture": cfg.architecture,
        "experts": cfg.num_moe_layers * cfg.num_experts,
        "expert_bytes": loaded.store.expert_nbytes,
        "dtype": args.dtype,
        "device": "cpu",
        "cpu_threads": args.cpu_threads,
        "link_gbps": args.link_gbps or None,  # None: no emulated link
        "link_latency_us": args.link_latency_us,
        "tasks": tasks,
        "warm_prompts": len(warm),
        "eval_prompts": len(evals),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "router_lookahead": args.router_lookahead,
        "seed": args.seed,
        "repeats": repeats,
        "order": "round-robin: each round runs every (buffer, policy) row once",
        "warmup": "1 all-resident run of the whole workload, not reported" if warmup else "none",
        "load_avg_before": load_before,
        "load_avg_after": _load_average(),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    return settings, rounds


def _arm_shares(trial, before: list[int] | None) -> dict[str, float] | None:
    """Share of the decode steps since ``before`` (steps per arm then) that ``trial`` ran in
    each of its arms; None without a trial or steps."""
    if trial is None or before is None:
        return None
    steps = [now - then for now, then in zip(trial.decode_steps_by_arm, before)]
    total = sum(steps)
    return {arm: n / total for arm, n in zip(trial.arms, steps)} if total else None


def _load_average() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


class _Runs:
    """One measured run of a (buffer size, policy) row: fresh engine and buffer, warm prompts, then
    the timed eval prompts. Every run must produce the same tokens as the first one."""

    def __init__(self, loaded, base, warm: list[list[int]], evals: list[list[int]], args) -> None:
        self.loaded, self.base, self.warm, self.evals, self.args = loaded, base, warm, evals, args
        self.reference = None

    def run_one(self, fraction: float, combo: tuple, log: list | None) -> tuple[PolicyResult, list | None]:
        """Returns the row's result and, for an on-demand run, its eval part's expert-access log
        (the oracle of the same buffer size replays it). Raises ConfigError when the outputs
        differ from the first run's."""
        from moe_runtime.engine.engine import LLMEngine
        from moe_runtime.errors import ConfigError
        from moe_runtime.prefetch import OracleSchedule

        label, prefetch, cache, overrides = combo
        rt = replace(
            self.base, buffer_fraction=fraction, prefetch_policy=prefetch, cache_policy=cache, **overrides
        )
        num_experts = self.loaded.config.num_experts
        context = {"oracle": OracleSchedule(log, num_experts)} if prefetch == "oracle" else None
        batch, new_tokens = self.args.batch, self.args.new_tokens
        with LLMEngine(self.loaded, rt, policy_context=context) as engine:
            if prefetch != "oracle":
                _run_batches(engine, self.warm, batch, new_tokens)
            if prefetch == "on-demand":
                engine.buffer.access_log = []
            st0 = engine.buffer.stats.snapshot()
            trial = getattr(engine.prefetcher, "trial", None)
            steps0 = list(trial.decode_steps_by_arm) if trial is not None else None
            times = DecodeTimes()
            tpots, outputs = _run_batches(engine, self.evals, batch, new_tokens, times)
            st1 = engine.buffer.stats
            access_log = engine.buffer.access_log if prefetch == "on-demand" else None
            if self.reference is None:
                self.reference = outputs
            elif outputs != self.reference:
                raise ConfigError(f"policy {label} changed the outputs (it must not)")
            tokens = sum(len(o) for o in outputs)
            lookups = st1.total_lookups - st0.total_lookups
            moved = st1.demand_bytes + st1.prefetch_bytes - st0.demand_bytes - st0.prefetch_bytes
            shares = _arm_shares(trial, steps0)
            res = PolicyResult(
                fraction,
                engine.buffer.num_slots,
                label,
                (st1.total_hits - st0.total_hits) / lookups if lookups else 0.0,
                1e3 * (st1.total_blocking_s - st0.total_blocking_s) / tokens,
                moved / tokens,
                1e3 * statistics.median(tpots),
                st1.prefetch_issued - st0.prefetch_issued,
                (st1.prefetch_bytes - st0.prefetch_bytes) // self.loaded.store.expert_nbytes,
                st1.prefetch_used - st0.prefetch_used,
                tokens,
                None if shares is None else shares[trial.arms[0]],
                shares,
                1e3 * statistics.median(times.cpu_s),
                statistics.median(times.expert_batches),
            )
        return res, access_log


def print_grid(data: dict) -> None:
    """Each point's tables (:func:`print_tables`), then the grid's verdict table."""
    for d in data["points"]:
        rows = [PolicyRow(**r) for r in d["results"]]
        print_tables(d["settings"], rows, d["verdicts"])
    print(render_grid(data))


def print_tables(settings: dict, rows: list[PolicyRow], comparisons: list[dict]) -> None:
    """Paper-style tables with median [min-max] over repeats: blocking and bytes normalised to
    on-demand; hit rate vs. oracle; TPOT vs on-demand (paired per round); then the verdicts."""
    from moeserve.bench.render import fmt_spread, verdict_rows
    from richconsole import Table, make_console

    console = make_console()
    table = Table(title=f"moeserve bench policies: median, spread min-max, of {settings['repeats']} repeats")
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
        "CPU ms/step",
        "batches/step",
        "TPOT vs on-demand",
        "gap closed",
        "bytes vs oracle",
    ):
        table.add_column(col, justify="right")
    for fraction in sorted({r.buffer_fraction for r in rows}):
        block = [r for r in rows if r.buffer_fraction == fraction]
        base = next((r for r in block if r.policy == "on-demand+lru"), None)
        oracle = next((r for r in block if r.policy == "oracle"), None)
        for r in block:
            table.add_row(
                f"{fraction:.0%}",
                r.policy,
                fmt_spread(r.hit_rate, r.hit_rate_min, r.hit_rate_max, "{:.3f}"),
                f"{r.hit_rate - oracle.hit_rate:+.3f}" if oracle else "",
                fmt_spread(r.blocking_ms_per_token, r.blocking_ms_per_token_min, r.blocking_ms_per_token_max),
                f"{r.blocking_ms_per_token / base.blocking_ms_per_token:.2f}"
                if base and base.blocking_ms_per_token
                else "",
                fmt_spread(
                    r.bytes_per_token, r.bytes_per_token_min, r.bytes_per_token_max, "{:.0f}", 1 / 1024
                ),
                f"{r.bytes_per_token / base.bytes_per_token:.2f}" if base and base.bytes_per_token else "",
                fmt_spread(r.tpot_ms, r.tpot_ms_min, r.tpot_ms_max),
                fmt_spread(r.cpu_ms, r.cpu_ms_min, r.cpu_ms_max),
                fmt_spread(
                    r.expert_batches_per_step,
                    r.expert_batches_per_step_min,
                    r.expert_batches_per_step_max,
                    "{:.1f}",
                ),
                fmt_spread(r.tpot_vs_on_demand, r.tpot_vs_on_demand_min, r.tpot_vs_on_demand_max, "{:.3f}"),
                fmt_spread(r.gap_closed, r.gap_closed_min, r.gap_closed_max),
                f"{r.bytes_vs_oracle:.2f}x" if r.bytes_vs_oracle is not None else "",
            )
    console.print(table)
    verdict_table = Table(title="eam vs on-demand+lru (decided only when the spreads separate)")
    header, lines = verdict_rows(comparisons)
    for col in header:
        verdict_table.add_column(col, justify="right")
    for line in lines:
        verdict_table.add_row(*line)
    console.print(verdict_table)
    console.print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
