"""Simulation speed: expert lookups simulated per CPU second, per policy.

Run ``python -m moeserve.sim.speed``.

Lookups are counted over the whole run (warm part included). CPU time (``time.process_time``) is
reported beside wall time because the machine may be shared. ``--trace`` measures a real trace;
without it a seeded synthetic trace of the profile's shape is generated: each request follows one
of a few per-layer expert distributions (Dirichlet, MoE-Infinity §3.1's group activation) and
each token draws its top-k without replacement (Gumbel top-k). ``--profile N`` prints the N
functions with the most own time (cProfile) for each policy.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import numpy as np

from moeserve.sim.cost import CostModel
from moeserve.sim.engine import SimConfig, Simulator
from moeserve.sim.hardware import get_hardware
from moeserve.sim.models import get_model
from moeserve.sim.workload import SimRequest, Workload, load_workload, split_warm_eval


def synthetic_workload(
    num_layers: int,
    num_experts: int,
    top_k: int,
    requests: int,
    tokens: int,
    prefill: int = 0,
    groups: int = 4,
    seed: int = 0,
) -> Workload:
    """``requests`` requests of ``prefill + tokens`` rows, tasks = groups (seeded)."""
    rng = np.random.default_rng(seed)
    patterns = rng.dirichlet(np.full(num_experts, 0.3), size=(groups, num_layers))  # [G, L, E]
    reqs = []
    for i in range(requests):
        g = i % groups
        rows = prefill + tokens
        gumbel = rng.gumbel(size=(rows, num_layers, num_experts))
        ids = np.argsort(-(np.log(patterns[g] + 1e-12)[None] + gumbel), axis=-1)[..., :top_k]  # [T, L, k]
        weights = np.full(ids.shape, 1.0 / top_k, dtype=np.float32)
        reqs.append(SimRequest(f"syn{i}", f"group{g}", ids.astype(np.int64), weights, prefill))
    return Workload("synthetic", num_layers, num_experts, top_k, reqs)


def measure(
    wl: Workload,
    profile: str,
    hardware: str,
    batch: int,
    slots: int | None,
    top: int,
    policies: list[str] | None = None,
) -> list[dict[str, object]]:
    """Run each bench combination (or those labelled in ``policies``) once; per-policy speed rows."""
    from moeserve.sim.runner import SIM_COMBOS, run_combos

    model = get_model(profile).mapped(wl.num_layers, wl.num_experts, wl.top_k)
    hw = get_hardware(hardware)
    cost = CostModel.roofline(model, hw)
    warm, evals = split_warm_eval(wl, 1)
    sim = Simulator(
        wl.num_layers, wl.num_experts, wl.top_k, model.expert_bytes, cost,
        SimConfig(slots=slots or model.buffer_slots(hw), batch=batch),
    )  # fmt: skip
    base = run_combos(sim, [SIM_COMBOS[0]], warm, evals)[0]
    rows = []
    for combo in [c for c in SIM_COMBOS if policies is None or c[0] in policies]:
        prof = cProfile.Profile() if top else None
        c0, t0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        log = base.access_log if combo[1] == "oracle" else None
        run = sim.run(combo[1], combo[2], warm, evals, oracle_log=log)
        if prof:
            prof.disable()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        rows.append(
            {
                "policy": combo[0],
                "lookups": run.sim_lookups,
                "cpu_s": round(cpu, 3),
                "wall_s": round(wall, 3),
                "lookups_per_cpu_s": int(run.sim_lookups / cpu) if cpu else 0,
            }
        )
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
            rows[-1]["profile"] = out.getvalue()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.sim.speed", description=__doc__)
    p.add_argument("--trace", default=None, help="trace file (default: synthetic at the profile's shape)")
    p.add_argument("--model-profile", default="mixtral-8x7b")
    p.add_argument("--hardware", default="a5000")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--buffer-slots", type=int, default=None)
    p.add_argument("--requests", type=int, default=8, help="synthetic requests")
    p.add_argument("--tokens", type=int, default=32, help="synthetic decode tokens per request")
    p.add_argument("--prefill", type=int, default=0, help="synthetic prompt tokens per request")
    p.add_argument("--profile", type=int, default=0, help="print the top N functions by own time")
    p.add_argument("--policies", default=None, help="comma-separated bench labels (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.trace:
        wl = load_workload(args.trace)
    else:
        m = get_model(args.model_profile)
        shape = (m.num_layers, m.num_experts, m.top_k)
        wl = synthetic_workload(*shape, args.requests, args.tokens, args.prefill)
    labels = args.policies.split(",") if args.policies else None
    rows = measure(wl, args.model_profile, args.hardware, args.batch, args.buffer_slots, args.profile, labels)
    settings = {
        "trace": args.trace or "synthetic",
        "shape": f"L={wl.num_layers} E={wl.num_experts} k={wl.top_k}",
        "requests": len(wl.requests),
        "batch": args.batch,
        "model_profile": args.model_profile,
        "hardware": args.hardware,
    }
    if args.json:
        print(json.dumps({"settings": settings, "results": rows}, indent=2))
        return 0
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    for r in rows:
        print(
            f"{r['policy']:>20}: {r['lookups']:>8} lookups in {r['cpu_s']:.2f} s CPU "
            f"({r['wall_s']:.2f} s wall) = {r['lookups_per_cpu_s']:>8} lookups/CPU-s"
        )
        if "profile" in r:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
