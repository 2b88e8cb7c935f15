"""Calibration: predict the runtime's own ``moeserve bench policies`` figures with the simulator.

Run ``python -m moeserve.sim.calibrate`` (the workload flags are ``bench policies``'s).

NOTE: what is measured and what is compared.
1. *Trace.* The bench's workload (prompt file, tasks, seed, warm/eval split, batches) runs once on
   the runtime with every expert resident and the tracer's ``TraceWriter`` attached, writing
   ``warm.jsonl`` and ``eval.jsonl``. Routing does not depend on the policy or the buffer size
   (the bench checks that outputs are equal), so every policy run replays this trace.
2. *Runtime figures.* ``bench.policies.measure`` itself (one round, no warm-up), unchanged, under a
   :class:`~moeserve.sim.probe.RuntimeProbe` that timestamps layers, forwards and link holds.
3. *Costs.* Two cost models, both built only from non-blocking times:
   ``offline`` -- measured before the benchmark on a resident engine (per-expert compute, dense
   part per layer, rest of a step) and through a real ``ExpertBuffer`` with the bench's link (the
   time a demand miss costs: queue, I/O thread wake-up, copy, ``LinkModel`` hold, hand-back); the
   simulator runs the tracer and policy hooks for real and charges their wall time
   (``host_time_scale=1``).
   ``in-run`` -- fitted per policy run from that run's own records: expert phases minus their
   blocking, gaps between layers (hooks included, so nothing is charged twice), rest of a step,
   the median link hold plus the hand-back latency measured offline. On a shared machine whose
   speed drifts by 2x within minutes, this separates the event model from machine noise.
4. *Prediction.* The simulator on the trace with each cost model, the same slots
   (``ceil(fraction * L * E)``) and batch. Targets: hit rate within 3 points, blocking time per
   token within 25 %.
5. *Hybrid execution* (:mod:`moeserve.sim.calibrate_hybrid`): the runtime's ``--expert-compute
   cpu`` row and ``auto`` rows (``--auto-policies``) against the simulator's, TPOT within 25 %.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeserve.bench import policies as bench
from moeserve.sim import calibrate_hybrid
from moeserve.sim.probe import Costs, RuntimeProbe, costs_from_records


def _resident_engine(loaded: Any, args: argparse.Namespace, recorder: Any | None = None) -> Any:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine

    rt = RuntimeConfig(
        dtype=args.dtype,
        max_batch_size=args.batch,
        cpu_threads=args.cpu_threads,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
    )
    return LLMEngine(loaded, rt, recorder=recorder)


def record_traces(loaded: Any, args: argparse.Namespace, warm: list, evals: list) -> tuple[Path, Path]:
    """Run the bench's warm then eval batches with every expert resident, writing the traces."""
    from tracer.recorder import RequestRecorder
    from tracer.trace_file import TraceWriter

    cfg = loaded.config
    paths = (args.out / "warm.jsonl", args.out / "eval.jsonl")
    recorder = RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k)
    with _resident_engine(loaded, args, recorder) as engine:
        for prompts, path in zip((warm, evals), paths):
            path.unlink(missing_ok=True)
            with TraceWriter(path) as writer:
                recorder.trace_writer = writer
                bench._run_batches(engine, prompts, args.batch, args.new_tokens)
    return paths


def measure_offline(loaded: Any, args: argparse.Namespace, warm: list, evals: list) -> tuple[Costs, dict]:
    """Costs from a resident run of the eval batches, and the link's demand-miss latency."""
    cfg = loaded.config
    with _resident_engine(loaded, args) as engine:
        bench._run_batches(engine, warm[: args.batch], args.batch, args.new_tokens)  # warm-up
        with RuntimeProbe() as probe:
            bench._run_batches(engine, evals, args.batch, args.new_tokens)
    costs = costs_from_records(probe.runs[0], cfg.num_moe_layers, cfg.top_k)
    link = measure_link(loaded, args)
    costs.transfer_s = link["hold_s"] + link["io_gap_s"]
    return costs, link


def measure_link(loaded: Any, args: argparse.Namespace, n: int = 40) -> dict[str, float]:
    """Through a real ``ExpertBuffer`` with the bench's link (means, seconds): a lone demand miss
    from asking to holding the expert (``demand_miss_s``); its link hold (``hold_s``); the rest,
    landing and handing back to the compute thread (``wake_s``); the I/O thread's gap between
    back-to-back copies (``io_gap_s``, median, four misses per layer); the nominal link time."""
    from moe_runtime.buffer import ExpertBuffer
    from moe_runtime.io.link import LinkModel

    store = loaded.store
    link = (args.link_gbps, args.link_latency_us)
    E, total = store.num_experts, store.num_layers * store.num_experts
    misses, gaps = [], []
    with RuntimeProbe() as probe:
        buf = ExpertBuffer(store, [torch.device("cpu")], 8, "lru", link)
        try:
            for i in range(n):  # one missing expert per layer
                layer, expert = divmod((7 * i) % total, E)
                t0 = time.perf_counter()
                gen = buf.run_layer(layer, [expert])
                next(gen)
                misses.append(time.perf_counter() - t0)
                gen.close()
            single = len(probe.runs[0].holds)
            for i in range(n // 2):  # four missing experts per layer: back-to-back copies
                layer = (3 * i + 1) % store.num_layers
                experts = sorted({(5 * i + j * 11) % E for j in range(4)})
                before = len(probe.runs[0].holds)
                for _ in buf.run_layer(layer, experts):
                    pass
                hs = probe.runs[0].holds[before:]
                gaps += [b[0] - a[1] for a, b in zip(hs, hs[1:])]
        finally:
            buf.close()
    holds = [end - start for start, end in probe.runs[0].holds[5:single]]
    miss, hold = float(np.mean(misses[5:])), float(np.mean(holds))
    return {
        "demand_miss_s": miss,
        "hold_s": hold,
        "wake_s": max(0.0, miss - hold),
        "io_gap_s": max(0.0, float(np.median(gaps))) if gaps else 0.0,
        "nominal_s": LinkModel(*link).transfer_seconds(store.expert_nbytes),
    }


def run_runtime(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """One round of ``bench policies`` on the same settings (its rows as dicts), under the probe."""
    keys = ("model", "prompts", "tasks", "warm", "eval", "batch", "new_tokens", "max_prompt_tokens",
            "fractions", "policies", "link_gbps", "link_latency_us", "dtype", "cpu_threads",
            "seed")  # fmt: skip
    parser = argparse.ArgumentParser()
    bench.register_bench(parser.add_subparsers())
    defaults = vars(parser.parse_args(["policies"]))  # every bench flag, then ours on top
    ns = argparse.Namespace(**{**defaults, **{k: getattr(args, k) for k in keys}, "json": True})
    with RuntimeProbe() as probe:
        settings, rounds = bench.measure(ns, repeats=1, warmup=False)  # one engine per row, in order
    return {"settings": settings, "results": [asdict(r) for r in rounds[0]]}, probe.runs


def replayable(combo: tuple) -> bool:
    """Whether the simulator can reproduce a ``bench.COMBOS`` row: it replays recorded routing
    only, so an ``eam`` row using the router lookahead (hidden states) has no counterpart."""
    from moe_runtime.config import RuntimeConfig

    _, prefetch, _, overrides = combo
    return prefetch != "eam" or overrides.get("router_lookahead", RuntimeConfig.router_lookahead) == 0


def simulate(
    costs: Costs,
    traces: tuple[Path, Path],
    fraction: float,
    combo: tuple[str, str, str],
    batch: int,
    expert_bytes: int,
    host_time_scale: float,
    wake_s: float,
    hybrid: Any = None,
) -> dict[str, float]:
    """The simulator's figures for one combination at one buffer fraction (``hybrid``: a
    :class:`~moeserve.sim.hybrid.HybridConfig`, where misses run)."""
    from moeserve.sim.cost import CostModel
    from moeserve.sim.engine import SimConfig, Simulator
    from moeserve.sim.runner import run_combos
    from moeserve.sim.workload import load_workload

    warm_wl, eval_wl = load_workload(traces[0]), load_workload(traces[1])
    cost = CostModel.measured(
        costs.transfer_s or 0.0, costs.expert_a_s, costs.expert_b_s, costs.layer_a_s, costs.layer_b_s,
        costs.step_s, wake_s, label="measured on the runtime", plan_s=costs.plan_s,
    )  # fmt: skip
    total = eval_wl.num_layers * eval_wl.num_experts
    config = SimConfig(
        slots=min(total, max(1, math.ceil(fraction * total))),
        batch=batch,
        layer_jitter_s=costs.layer_jitter_s,
        hybrid=hybrid,
    )
    config.host_time_scale = host_time_scale
    sim = Simulator(eval_wl.num_layers, eval_wl.num_experts, eval_wl.top_k, expert_bytes, cost, config)
    run = run_combos(sim, [combo], warm_wl.requests, eval_wl.requests)[-1]
    return {
        "hit_rate": run.hit_rate,
        "blocking_ms_per_token": 1e3 * run.blocking_s_per_token,
        "bytes_per_token": run.bytes_per_token,
        "tpot_ms": 1e3 * run.tpot_s,
        "cpu_per_token": _cpu(run),
    }


def _cpu(run: Any) -> float:
    """Experts computed on the CPU per generated token (0 without hybrid execution)."""
    if not run.hybrid or not run.tokens:
        return 0.0
    d, p = run.hybrid["decode"], run.hybrid["prefill"]
    return (d["cpu"] * d["steps"] + p["cpu"] * p["steps"]) / run.tokens


def _row(r: dict[str, Any], s: dict[str, float], mode: str, rep: int, spread: str) -> dict[str, Any]:
    block = r["blocking_ms_per_token"]
    err = s["blocking_ms_per_token"] / block - 1 if block else None
    return {
        **calibrate_hybrid.base_row(r, s, mode, rep),
        "hit_diff_points": round(100 * (s["hit_rate"] - r["hit_rate"]), 2),
        "block_ms_tok_runtime": round(block, 3),
        "block_ms_tok_runtime_spread": spread,
        "block_ms_tok_sim": round(s["blocking_ms_per_token"], 3),
        "block_rel_err": None if err is None else round(err, 3),
        "tpot_ms_runtime": round(r["tpot_ms"], 3),
        "tpot_ms_sim": round(s["tpot_ms"], 3),
        "hit_ok": abs(s["hit_rate"] - r["hit_rate"]) <= 0.03,
        "block_ok": err is not None and abs(err) <= 0.25,
    }


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole calibration (see the module note); returns the JSON document."""
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.loader import load_checkpoint
    from moeserve.commands.common import resolve_model

    torch.set_num_threads(args.cpu_threads)
    args.model = resolve_model(args)
    args.out.mkdir(parents=True, exist_ok=True)
    base = RuntimeConfig(
        dtype=args.dtype, max_batch_size=args.batch, cpu_threads=args.cpu_threads,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
    )  # fmt: skip
    loaded = load_checkpoint(args.model, base)
    cfg, nbytes = loaded.config, loaded.store.expert_nbytes
    warm, evals, _ = bench.load_workload(
        args.prompts, loaded.tokenizer, args.tasks, args.warm, args.eval, args.max_prompt_tokens, args.seed
    )
    traces = record_traces(loaded, args, warm, evals)
    offline, link = measure_offline(loaded, args, warm, evals)
    print(f"offline costs: {asdict(offline)}; link: {link}", file=sys.stderr)
    reps = [run_runtime(args) for _ in range(args.repeat)]
    rows_h = calibrate_hybrid.hybrid_rows(args.auto_policies) if args.hybrid else []
    reps_h = args.repeat if rows_h else 0
    hyb = [calibrate_hybrid.run_runtime(loaded, args, warm, evals, rows_h) for _ in range(reps_h)]
    offline_cpu = None
    if rows_h:
        offline_cpu = calibrate_hybrid.offline_cpu_cost(
            loaded, calibrate_hybrid.threads(args), args.cpu_threads
        )
    settings = {**reps[0][0]["settings"], "traces": [str(t) for t in traces], "repeats": args.repeat}
    rows: list[dict[str, Any]] = []
    inrun_costs: list[dict[str, Any]] = []
    offline_sim: dict[tuple[float, str], dict[str, float]] = {}
    for rep, (runtime, runs) in enumerate(reps):
        results = runtime["results"]
        if len(runs) != len(results):  # bench.run builds one engine per result row, in order
            raise RuntimeError(f"probe saw {len(runs)} runs for {len(results)} benchmark rows")
        for n, (r, rec) in enumerate(zip(results, runs)):
            if r["policy"] == "all-resident":  # the TPOT reference row: nothing to simulate
                continue
            combo = next(c for c in bench.COMBOS if c[0] == r["policy"])[:3]
            blocks = [rp[0]["results"][n]["blocking_ms_per_token"] for rp in reps]
            spread = f"{min(blocks):.3f}-{max(blocks):.3f}"
            inrun = costs_from_records(rec, cfg.num_moe_layers, cfg.top_k)
            gap = link["io_gap_s"] if inrun.io_gap_s is None else inrun.io_gap_s
            inrun.transfer_s = (inrun.transfer_s or link["hold_s"]) + gap
            inrun_costs.append({"repeat": rep, "buffer_fraction": r["buffer_fraction"], "policy": r["policy"],
                                **asdict(inrun)})  # fmt: skip
            frac, wake = r["buffer_fraction"], link["wake_s"]
            key = (frac, r["policy"])
            if key not in offline_sim:
                offline_sim[key] = simulate(offline, traces, frac, combo, args.batch, nbytes, 1.0, wake)
            s_in = simulate(inrun, traces, frac, combo, args.batch, nbytes, 0.0, wake)
            rows += [_row(r, offline_sim[key], "offline", rep, spread), _row(r, s_in, "in-run", rep, spread)]
    hybrid_rows: list[dict[str, Any]] = []
    for rep, results in enumerate(hyb):
        got, costs = calibrate_hybrid.compare(
            results, offline, offline_cpu, link, traces, args, loaded, rep, simulate
        )
        hybrid_rows += got
        inrun_costs += costs
    return {
        "settings": settings,
        "offline_costs": asdict(offline),
        "link": link,
        "in_run_costs": inrun_costs,
        "comparison": rows,
        "hybrid": {
            "cpu_threads": calibrate_hybrid.threads(args),
            "offline_cpu": None if offline_cpu is None else asdict(offline_cpu),
            "comparison": hybrid_rows,
            "runtime": [[r for _, _, r, _ in results] for results in hyb],
        },
        "runtime": [rp[0]["results"] for rp in reps],
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Per cost mode: how many rows meet each target."""
    out = {}
    for mode in ("offline", "in-run"):
        sel = [r for r in rows if r["costs"] == mode]
        out[mode] = (
            f"hit within 3 pts: {sum(r['hit_ok'] for r in sel)}/{len(sel)}, "
            f"blocking within 25%: {sum(r['block_ok'] for r in sel)}/{len(sel)}"
        )
    return out


def print_comparison(doc: dict[str, Any], seconds: float) -> None:
    from richconsole import Table, make_console

    console = make_console()
    table = Table(title="simulator vs runtime (moeserve bench policies)")
    cols = ("rep", "buffer", "policy", "costs", "hit runtime", "hit sim", "diff pts",
            "block ms/tok runtime", "runtime spread", "block ms/tok sim", "block err", "TPOT runtime",
            "TPOT sim", "within target")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in doc["comparison"]:
        err = "-" if r["block_rel_err"] is None else f"{100 * r['block_rel_err']:+.0f}%"
        ok = ", ".join(x for x, good in (("hit", r["hit_ok"]), ("block", r["block_ok"])) if good) or "no"
        table.add_row(
            str(r["repeat"]), f"{r['buffer_fraction']:.0%}", r["policy"], r["costs"],
            f"{r['hit_runtime']:.3f}", f"{r['hit_sim']:.3f}", f"{r['hit_diff_points']:+.1f}",
            f"{r['block_ms_tok_runtime']:.3f}", r["block_ms_tok_runtime_spread"],
            f"{r['block_ms_tok_sim']:.3f}", err, f"{r['tpot_ms_runtime']:.2f}", f"{r['tpot_ms_sim']:.2f}", ok,
        )  # fmt: skip
    console.print(table)
    for mode, text in summary(doc["comparison"]).items():
        console.print(f"{mode} costs: {text}")
    o, lk = doc["offline_costs"], doc["link"]
    us = {k: round(1e6 * v, 2) for k, v in {**o, **lk}.items() if isinstance(v, float)}
    if doc["hybrid"]["comparison"]:
        calibrate_hybrid.print_rows(console, doc["hybrid"]["comparison"])
    console.print(f"offline costs and link (us): {us}; calibration took {seconds:.0f} s", soft_wrap=True)
    console.print("settings: " + ", ".join(f"{k}={v}" for k, v in doc["settings"].items()), soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    from moeserve.commands.common import add_model_arg

    p = argparse.ArgumentParser(prog="python -m moeserve.sim.calibrate", description=__doc__.split("\n")[0])
    add_model_arg(p)
    prompts = Path(__file__).resolve().parents[2].parent / "shared/data/prompts/prompts_combined.jsonl"
    p.add_argument("--prompts", type=Path, default=prompts)
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--eval", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument(
        "--policies",
        default=",".join(c[0] for c in bench.COMBOS if replayable(c)),
        help="bench rows to compare (default: every row the simulator can replay)",
    )
    p.add_argument("--link-gbps", type=float, default=0.5)
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runtime benchmark runs (shows its own spread)")
    p.add_argument(
        "--auto-policies",
        default=calibrate_hybrid.AUTO_POLICIES,
        help="bench rows also run with --expert-compute auto (beside one cpu row per buffer size)",
    )
    p.add_argument("--no-hybrid", dest="hybrid", action="store_false", help="skip the cpu and auto rows")
    p.add_argument("--out", type=Path, default=Path("sim-calibration"), help="folder for traces and JSON")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for label in args.policies.split(","):
        combo = next((c for c in bench.COMBOS if c[0] == label), None)
        if combo is None or not replayable(combo):
            why = (
                "unknown" if combo is None else "uses the router lookahead, which the simulator cannot replay"
            )
            p.error(f"--policies: {label!r} is {why}")
    t0 = time.perf_counter()
    doc = calibrate(args)
    (args.out / "calibration.json").write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_comparison(doc, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
