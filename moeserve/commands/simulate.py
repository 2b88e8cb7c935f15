"""``moeserve simulate``: replay a routing trace through the runtime's policies at a real model's scale.

See ``docs/simulator.md``. One policy prints hit rate, blocking time per token, bytes per token and
the predicted TPOT; ``--all-policies`` prints the paper-style tables (MoE-Infinity Tables 2, 3, 5).
"""

from __future__ import annotations

import argparse
import json
import math
import time


def register(sub: argparse._SubParsersAction) -> None:
    from tracer.eamc import DEFAULT_CAPACITY

    p = sub.add_parser(
        "simulate",
        help="trace-driven simulation of expert prefetching/caching at a real model's scale",
        description="Replay a trace file (moeserve-trace/1) through the runtime's buffer state machine, "
        "cache and prefetch policies with a roofline cost model instead of real copies and kernels.",
    )
    p.add_argument("--trace", default=None, help="trace file (moeserve-trace/1 JSON lines); required")
    p.add_argument("--list-profiles", action="store_true", help="print the model and hardware profiles")
    p.add_argument("--warm-trace", default=None, help="separate trace that warms (default: split --trace)")
    p.add_argument("--model-profile", default="mixtral-8x7b", help="model profile (default: mixtral-8x7b)")
    p.add_argument("--hardware", default="a5000", help="GPU+LINK profile or alias (default: a5000)")
    p.add_argument("--policy", default="eam", help="prefetch policy, or a comma list (default: eam)")
    p.add_argument("--cache-policy", default=None, help="cache policy (default: the policy's pairing)")
    p.add_argument("--all-policies", action="store_true", help="every combination of bench policies")
    p.add_argument("--buffer-slots", type=int, default=None, help="slots in total (default: from memory)")
    p.add_argument("--num-devices", type=int, default=1, help="GPUs, experts hashed over them")
    p.add_argument("--batch", type=int, default=1, help="trace requests decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="token budget per step")
    p.add_argument("--warm", type=int, default=1, help="requests per task that warm the EAMC (default 1)")
    p.add_argument("--warm-pick", default="first", choices=["first", "last"], help="which ones warm")
    p.add_argument(
        "--map-profile",
        action="store_true",
        help="allow a trace of another shape: the profile's costs on the trace's L, E, k (labelled)",
    )
    p.add_argument("--kv-tokens", type=int, default=None, help="KV-cache tokens reserved (default 8192)")
    p.add_argument("--prefetch-depth", type=int, default=None, help="layers a prefetch plan covers")
    p.add_argument(
        "--eamc-capacity",
        type=int,
        default=DEFAULT_CAPACITY,
        help=f"EAMC entries (default: {DEFAULT_CAPACITY})",
    )
    p.add_argument("--host-overhead-us", type=float, default=0.0, help="host time per MoE layer (µs)")
    p.add_argument(
        "--layer-jitter-us", type=float, default=0.0, help="std of each layer's dense time, seeded (µs)"
    )
    p.add_argument(
        "--lookahead-precision",
        default=None,
        help="model the eam row's router lookahead: per-distance top-k precision, comma-separated "
        "(e.g. 0.647,0.576) or the JSON of moeserve bench lookahead (default: no lookahead)",
    )
    p.add_argument(
        "--expert-compute",
        default="device",
        help="where missed experts run: device (copied), cpu, auto (hybrid, the runtime's placement), "
        "or a comma list of them, one set of rows each (default: device)",
    )
    p.add_argument(
        "--cpu-expert-threads",
        type=int,
        default=0,
        help="the CPU pool's threads, each CPU expert split over all (default 0: the host's, as the runtime)",
    )
    p.add_argument(
        "--split-eval",
        type=int,
        default=None,
        help="cut the measured requests into N sequences of consecutive tokens (a batch of N streams)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=0,
        help="also run each row with an N-token prompt before every measured request (routed as the "
        "trace's tokens) and report its prefill steps' placement",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def lookahead_precision(value: str | None) -> tuple[float, ...]:
    """``--lookahead-precision``: floats in [0, 1] (comma-separated) or a ``bench lookahead --json``
    file (its ``topk_precision`` by distance).

    Raises:
        ConfigError: unreadable file, bad JSON or value, naming it.
    """
    from pathlib import Path

    from moe_runtime.errors import ConfigError

    if value is None:
        return ()
    if value.endswith(".json"):
        try:
            rows = json.loads(Path(value).read_text())["results"]
            vals = [float(r["topk_precision"]) for r in sorted(rows, key=lambda r: r["distance"])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--lookahead-precision {value}: not a bench lookahead JSON ({exc})") from None
    else:
        try:
            vals = [float(v) for v in value.split(",")]
        except ValueError:
            raise ConfigError(f"--lookahead-precision {value!r}: expected numbers like 0.647,0.576") from None
    if not vals or not all(0 <= v <= 1 for v in vals):
        raise ConfigError(f"--lookahead-precision {value!r}: each precision must lie in [0, 1]")
    return tuple(vals)


def _check(args: argparse.Namespace) -> None:
    from moe_runtime.errors import ConfigError

    for name in ("batch", "num_devices", "max_num_batched_tokens", "eamc_capacity"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.buffer_slots is not None and args.buffer_slots < 1:
        raise ConfigError(f"--buffer-slots must be >= 1, got {args.buffer_slots}")
    if args.warm < 0:
        raise ConfigError(f"--warm must be >= 0, got {args.warm}")
    if args.prefetch_depth is not None and args.prefetch_depth < 1:
        raise ConfigError(f"--prefetch-depth must be >= 1, got {args.prefetch_depth}")
    if not args.layer_jitter_us >= 0:  # also rejects nan
        raise ConfigError(f"--layer-jitter-us must be >= 0, got {args.layer_jitter_us}")
    if args.split_eval is not None and args.split_eval < 1:
        raise ConfigError(f"--split-eval must be >= 1, got {args.split_eval}")
    for name in ("cpu_expert_threads", "prefill_tokens"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    from moeserve.sim.hybrid import MODES

    for mode in args.expert_compute.split(","):
        if mode not in MODES:
            raise ConfigError(f"--expert-compute: {mode!r} is not one of {', '.join(MODES)}")


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError
    from moeserve.bench.policies import COMBOS
    from moeserve.sim.cost import CostModel
    from moeserve.sim.engine import SimConfig, Simulator
    from moeserve.sim.hardware import get_hardware
    from moeserve.sim.hybrid import CPUCost, HybridConfig
    from moeserve.sim.models import DEFAULT_KV_TOKENS, get_model
    from moeserve.sim.report import add_relative, as_json, print_single, print_tables, row_of
    from moeserve.sim.runner import combo_for, run_combos, run_modes
    from moeserve.sim.workload import load_workload, split_requests, split_warm_eval

    if args.list_profiles:
        from moeserve.sim.report import print_profiles

        print_profiles(args.kv_tokens or DEFAULT_KV_TOKENS)
        return 0
    if not args.trace:
        raise ConfigError("--trace is required (a moeserve-trace/1 file; see moeserve trace import)")
    _check(args)
    profile = get_model(args.model_profile)
    hw = get_hardware(args.hardware)
    combos = (
        list(COMBOS)
        if args.all_policies
        else [combo_for(p.strip(), args.cache_policy) for p in args.policy.split(",") if p.strip()]
    )
    wl = load_workload(args.trace)
    shape = (wl.num_layers, wl.num_experts, wl.top_k)
    if shape != (profile.num_layers, profile.num_experts, profile.top_k):
        if not args.map_profile:
            raise ConfigError(
                f"--trace {args.trace} has L={shape[0]} E={shape[1]} k={shape[2]} but --model-profile "
                f"{profile.name} has L={profile.num_layers} E={profile.num_experts} k={profile.top_k}; "
                "pass --map-profile to replay it with the profile's expert and layer costs"
            )
        profile = profile.mapped(*shape)
    if args.warm_trace:
        warm_wl = load_workload(args.warm_trace)
        if (warm_wl.num_layers, warm_wl.num_experts, warm_wl.top_k) != shape:
            raise ConfigError(f"--warm-trace {args.warm_trace}: shape differs from --trace {args.trace}")
        warm, evals = warm_wl.requests, wl.requests
    else:
        warm, evals = split_warm_eval(wl, args.warm, args.warm_pick)
    if args.split_eval:
        evals = split_requests(evals, args.split_eval)
    kv_tokens = DEFAULT_KV_TOKENS if args.kv_tokens is None else args.kv_tokens
    slots = args.buffer_slots or args.num_devices * profile.buffer_slots(hw, kv_tokens)
    slots = min(slots, profile.total_experts)
    cost = CostModel.roofline(profile, hw, args.host_overhead_us)
    threads = args.cpu_expert_threads or hw.host.default_threads(args.num_devices)
    hybrid = HybridConfig(
        "device",
        threads,
        CPUCost.pool(profile, hw.host, threads),
        profile.expert_bytes / ((hw.link.gbps + hw.host.pool_gbps(threads)) * 1e9),
        cost.expert_bytes_s,
    )
    config = SimConfig(
        slots=slots,
        num_devices=args.num_devices,
        batch=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefetch_depth=args.prefetch_depth,
        eamc_capacity=args.eamc_capacity,
        layer_jitter_s=args.layer_jitter_us * 1e-6,
        lookahead_precision=lookahead_precision(args.lookahead_precision),
        hybrid=hybrid,
    )
    sim = Simulator(*shape, profile.expert_bytes, cost, config)
    t0 = time.perf_counter()
    c0 = time.process_time()
    modes = args.expert_compute.split(",")
    if modes == ["device"] and not args.prefill_tokens:
        runs = run_combos(sim, combos, warm, evals)
    else:
        runs = run_modes(sim, combos, modes, warm, evals, args.prefill_tokens, wl.requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = add_relative([row_of(r) for r in runs])
    simulated = sum(r.sim_lookups for r in runs)
    settings = {
        "trace": args.trace,
        "warm": args.warm_trace or f"{args.warm}/task ({args.warm_pick})",
        "warm_requests": len(warm),
        "eval_requests": len(evals),
        "model_profile": profile.name,
        "expert_MiB": round(profile.expert_bytes / 2**20, 1),
        "hardware": hw.describe(),
        "host": hw.host.describe(),
        "slots": slots,
        "slots_share": f"{slots / profile.total_experts:.1%}",
        "num_devices": args.num_devices,
        "batch": args.batch,
        "layer_jitter_us": args.layer_jitter_us,
        "lookahead_precision": ",".join(f"{v:g}" for v in config.lookahead_precision) or "none",
        "expert_compute": args.expert_compute,
        "cpu_threads": threads,
        "cpu_expert_us_1tok": round(hybrid.cpu.seconds(1) * 1e6, 2),
        "cpu_expert_us_128tok": round(hybrid.cpu.seconds(128) * 1e6, 2),
        "measured_sequences": len(evals),
        "prefill_tokens": args.prefill_tokens,
        **cost.describe(),
        "sim_lookups": simulated,
        "sim_wall_s": round(wall, 2),
        "lookups_per_cpu_s": math.floor(simulated / cpu) if cpu else 0,
    }
    if args.json:
        print(json.dumps(as_json(settings, rows), indent=2))
    elif len(rows) == 1:
        print_single(settings, rows[0])
    else:
        print_tables(settings, rows, title=f"moeserve simulate: {profile.name} on {hw.name}")
    return 0
