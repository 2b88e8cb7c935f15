"""Fingerprint the simulator's outputs, to check that a speed change leaves them bit-identical.

Runs every bench combination (``moeserve.sim.runner.SIM_COMBOS``) on six cases -- the
imported Mixtral-8x7B trace at 57 and 40 slots (batch 1 and 4), on 2 devices with depth 3, at 57
slots with the router lookahead modelled (batch 4), and a seeded synthetic qwen3-30b-a3b-shaped
workload at 600 and 300 slots (batch 8 and 4, 3 devices) -- and writes every counter, TPOT,
simulated seconds and step count to JSON (48 runs, about 50 CPU-s). A fingerprint written before
a case was added compares on the runs it has. ``--compare OLD NEW`` lists the runs that differ, with their hit-rate and blocking
changes.

    moeserve trace import --num-experts 8 --out /tmp/mixtral_8x7b.jsonl \\
        ../shared/data/routing_traces/mixtral_8x7b_instruct_fp8/{gsm8k,humaneval}_2_routing.jsonl
    python tools/sim_fingerprint.py --trace /tmp/mixtral_8x7b.jsonl --out before.json
    (change the code)
    python tools/sim_fingerprint.py --trace /tmp/mixtral_8x7b.jsonl --out after.json
    python tools/sim_fingerprint.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moeserve.sim.cost import CostModel
from moeserve.sim.engine import SimConfig, Simulator
from moeserve.sim.hardware import get_hardware
from moeserve.sim.models import get_model
from moeserve.sim.runner import SIM_COMBOS, run_combos
from moeserve.sim.speed import synthetic_workload
from moeserve.sim.workload import load_workload, split_warm_eval


def cases(trace: str):
    mix = load_workload(trace)
    yield "mix-b1", mix, "mixtral-8x7b", dict(slots=57, batch=1)
    yield "mix-b4-s40", mix, "mixtral-8x7b", dict(slots=40, batch=4)
    yield "mix-b2-d2", mix, "mixtral-8x7b", dict(slots=96, batch=2, num_devices=2, prefetch_depth=3)
    # the router lookahead modelled at bench lookahead's precision (the runtime's default plan)
    yield "mix-b4-la", mix, "mixtral-8x7b", dict(slots=57, batch=4, lookahead_precision=(0.647,))
    qwen = synthetic_workload(48, 128, 8, 16, 16, prefill=4)
    yield "qwen-b8", qwen, "qwen3-30b-a3b", dict(slots=600, batch=8)
    yield "qwen-b4-s300", qwen, "qwen3-30b-a3b", dict(slots=300, batch=4, num_devices=3)


def fingerprint(trace: str) -> dict[str, dict]:
    out = {}
    for name, wl, profile, kw in cases(trace):
        model = get_model(profile).mapped(wl.num_layers, wl.num_experts, wl.top_k)
        cost = CostModel.roofline(model, get_hardware("a5000"))
        warm, evals = split_warm_eval(wl, 1)
        sim = Simulator(wl.num_layers, wl.num_experts, wl.top_k, model.expert_bytes, cost, SimConfig(**kw))
        for run in run_combos(sim, SIM_COMBOS, warm, evals):
            out[f"{name}/{run.label}"] = {
                "stats": dict(run.stats),
                "tpot": run.tpot_s,
                "sim_s": run.sim_seconds,
                "steps": run.steps,
            }
    return out


def compare(old: dict, new: dict) -> int:
    differ = [k for k in old if old[k] != new.get(k)]
    print(f"{len(differ)} of {len(old)} runs differ")
    for k in differ:
        a, b = old[k]["stats"], new[k]["stats"]
        ha, hb = a["hits"] / a["lookups"], b["hits"] / b["lookups"]
        ba, bb = a["blocking_s"], b["blocking_s"]
        print(f"{k}: hit rate {ha:.4f} -> {hb:.4f}, blocking {ba:.6g} -> {bb:.6g} s")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="imported Mixtral-8x7B trace (moeserve trace import)")
    p.add_argument("--out", help="write the fingerprint here")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two fingerprints")
    args = p.parse_args(argv)
    if args.compare:
        old, new = (json.loads(Path(f).read_text()) for f in args.compare)
        return compare(old, new)
    if not (args.trace and args.out):
        p.error("give --trace and --out, or --compare OLD NEW")
    t0 = time.process_time()
    result = fingerprint(args.trace)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"{len(result)} runs in {time.process_time() - t0:.1f} CPU-s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
