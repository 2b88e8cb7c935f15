"""``moeserve bench experts``: one MoE layer's routed experts, per-expert loop against grouped GEMMs.

For each selected expert shape and token count, a host store of one layer's experts (random
weights, seeded) is loaded all resident into an :class:`~moe_runtime.buffer.ExpertBuffer` on
``--device``; tokens are routed to ``top_k`` distinct random experts (seeded). The runtime's own
``moe_runtime.layers.experts.run_experts`` then runs the layer on each path (``loop``: two
``F.linear`` per expert over rows gathered and sorted as for the grouped call; ``grouped``: one
``grouped_mm`` per projection over the slot buffer; ``few``: two ``F.linear`` per expert on its
own rows with no grouped index work, which steps of few tokens run), after
``--warmup`` calls, ``--repeats`` times ``--calls`` calls each (CUDA synchronised around each
repeat; on CPU with one intra-op thread the clock is the thread's CPU time, which other processes
on a shared host do not inflate). Reported per row: median and min/max of the per-call time in
µs, the speed-up grouped over loop, whether the paths' outputs are bit-identical, and the path
the engine runs at that token count (``step runs``). ``--markdown FILE``
writes the table with its settings as a Markdown document.

Shapes (hidden H, expert width I, experts E, top-k) come from the one table of real shapes,
:data:`moeserve.checkpoints.shapes.SHAPES` (the public configs; ``moeserve make-checkpoint``
writes from it too); ``bundled`` is read from the bundled checkpoint's ``config.json``. Mixtral's
layer is 2.8 GB in bf16: select it explicitly (``--shapes mixtral-8x7b``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from moe_runtime.errors import ConfigError
from moeserve.checkpoints.shapes import SHAPES

DEFAULT_SHAPES = "bundled,qwen3-30b-a3b"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shape_of(name: str) -> tuple[int, int, int, int]:
    """``(H, I, E, top_k)`` of a shape name (``bundled`` reads the bundled checkpoint).

    Raises:
        ConfigError: an unknown name (the known ones are listed).
    """
    if name == "bundled":
        from moe_runtime.assets import default_model_dir

        c = json.loads((default_model_dir() / "config.json").read_text())
        return c["hidden_size"], c["moe_intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"]
    if name not in SHAPES:
        raise ConfigError(f"--shapes: unknown shape {name!r} (known: bundled, {', '.join(SHAPES)})")
    s = SHAPES[name]
    return s.hidden, s.moe_intermediate, s.experts, s.top_k


def clock_for(device: torch.device, cpu_threads: int) -> str:
    """``thread``: the calling thread's CPU time (CPU, one intra-op thread: all the work is on this
    thread, and other processes on a shared host do not inflate it); else ``wall`` (CUDA
    synchronised around each repeat)."""
    return "thread" if device.type == "cpu" and cpu_threads == 1 else "wall"


def _time_calls(fn, calls: int, repeats: int, warmup: int, device: torch.device, clock: str) -> list[float]:
    """Per-call seconds of ``fn`` for each of ``repeats`` repeats of ``calls`` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = time.thread_time if clock == "thread" else time.perf_counter
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = now()
        for _ in range(calls):
            fn()
        sync()
        out.append((now() - t0) / calls)
    return out


def bench_shape(
    name: str,
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    calls: int,
    repeats: int,
    warmup: int,
    seed: int,
    clock: str = "wall",
) -> dict[str, Any]:
    """One row: the three paths (``loop``, ``grouped``, ``few``) on one layer of shape ``name``
    with ``tokens`` tokens."""
    from moe_runtime.buffer import ExpertBuffer
    from moe_runtime.layers.experts import run_experts, select_expert_path, step_path
    from moe_runtime.store import HostExpertStore

    hidden, inter, num_experts, top_k = shape_of(name)
    gen = torch.Generator().manual_seed(seed)
    store = HostExpertStore(1, num_experts, hidden, inter, dtype, pin_memory=device.type == "cuda")
    for key in range(num_experts):  # row by row: no fp32 copy of the whole layer
        store.data[key].copy_(torch.randn(store.expert_numel, generator=gen) * hidden**-0.5)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    ids_host = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k].numpy()
    weights = torch.rand(tokens, top_k, generator=gen).softmax(dim=1).to(device=device, dtype=dtype)
    needed = np.flatnonzero(np.bincount(ids_host.reshape(-1), minlength=num_experts)).tolist()
    buf = ExpertBuffer(store, [device], num_experts)
    try:
        outs, times = {}, {}
        for path in ("loop", "grouped", "few"):

            def call(path=path):
                return run_experts(x, weights, ids_host, buf.start_layer(0, needed), num_experts, path)[0]

            outs[path] = call()
            times[path] = _time_calls(call, calls, repeats, warmup, device, clock)
    finally:
        buf.close()
    row: dict[str, Any] = {
        "shape": name,
        "hidden": hidden,
        "intermediate": inter,
        "experts": num_experts,
        "top_k": top_k,
        "tokens": tokens,
        "experts_used": len(needed),
        "probe_path": select_expert_path(device, dtype),
        "step_path": step_path(select_expert_path(device, dtype), device, tokens),
        "identical": all(torch.equal(outs["loop"], o) for o in outs.values()),
    }
    for path, ts in times.items():
        us = [t * 1e6 for t in ts]
        row[f"{path}_us"] = {"median": statistics.median(us), "min": min(us), "max": max(us), "runs": us}
    row["speedup"] = row["loop_us"]["median"] / row["grouped_us"]["median"]
    return row


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experts", help="one MoE layer's experts: per-expert loop vs grouped GEMMs")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument(
        "--dtype", default="bf16", choices=list(DTYPES), help="weights and activations (default: bf16)"
    )
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help=f"comma list of bundled, {', '.join(SHAPES)} (default: {DEFAULT_SHAPES})",
    )
    p.add_argument("--tokens", default="1,8", help="comma list of tokens per layer call (default: 1,8)")
    p.add_argument("--calls", type=int, default=5, help="calls per timed repeat (default: 5)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, >= 3 (default: 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=1, help="torch intra-op threads on CPU (default: 1)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", default=None, help="also write the table with its settings to this file")
    p.set_defaults(func=run)


def _cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.machine()


def _positive_ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ConfigError(f"{flag}: expected a comma list of integers >= 1, got {text!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    from moe_runtime.device import normalize_device

    device = normalize_device(args.device)
    tokens = _positive_ints("--tokens", args.tokens)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in names:
        shape_of(name)  # unknown names fail before any work
    if args.repeats < 3:
        raise ConfigError(f"--repeats must be >= 3 (median and spread), got {args.repeats}")
    for flag, value in (("--calls", args.calls), ("--cpu-threads", args.cpu_threads)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    torch.set_num_threads(args.cpu_threads)
    dtype = DTYPES[args.dtype]
    settings = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "load_average": round(os.getloadavg()[0], 2),
        "dtype": args.dtype,
        "calls": args.calls,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": args.seed,
        "cpu_threads": args.cpu_threads,
        "clock": clock_for(device, args.cpu_threads),
        "torch": torch.__version__,
    }
    rows = [
        bench_shape(n, t, device, dtype, args.calls, args.repeats, args.warmup, args.seed, settings["clock"])
        for n in names
        for t in tokens
    ]
    data = {"settings": settings, "results": rows}
    table = render(data)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(_document(data, table))
    print(json.dumps(data, indent=2) if args.json else table)
    return 0


def render(data: dict[str, Any]) -> str:
    """Markdown: settings line, then one row per (shape, tokens)."""
    s = data["settings"]
    head = (
        f"device {s['device']} ({s['device_name']}), {s['dtype']}, torch {s['torch']}, "
        f"{s['cpu_threads']} CPU thread(s), load average {s['load_average']}; {s['warmup']} warm-up "
        f"calls, median [min-max] of {s['repeats']} repeats x {s['calls']} calls ({s['clock']} clock), "
        f"seed {s['seed']}"
    )
    lines = [
        head,
        "",
        "| shape | H | I | E | top-k | tokens | experts used | loop µs | grouped µs | few µs "
        "| speed-up | identical | load picks | step runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        cells = " | ".join(
            f"{t['median']:.0f} [{t['min']:.0f}-{t['max']:.0f}]"
            for t in (r["loop_us"], r["grouped_us"], r["few_us"])
        )
        lines.append(
            f"| {r['shape']} | {r['hidden']} | {r['intermediate']} | {r['experts']} | {r['top_k']} | "
            f"{r['tokens']} | {r['experts_used']} | {cells} | {r['speedup']:.2f}x | "
            f"{'yes' if r['identical'] else 'NO'} | {r['probe_path']} | {r['step_path']} |"
        )
    return "\n".join(lines)


def _document(data: dict[str, Any], table: str) -> str:
    s = data["settings"]
    shapes = ",".join(dict.fromkeys(r["shape"] for r in data["results"]))
    tokens = ",".join(str(t) for t in dict.fromkeys(r["tokens"] for r in data["results"]))
    cmd = (
        f"moeserve bench experts --device {s['device'].split(':')[0]} --dtype {s['dtype']} "
        f"--shapes {shapes} --tokens {tokens} --repeats {s['repeats']} --calls {s['calls']} "
        f"--markdown bench-experts.md"
    )
    return f"""# Routed experts: per-expert loop, grouped GEMMs, few-token path (`moeserve bench experts`)

Generated by `moeserve bench experts` (do not edit by hand). One MoE layer's experts, all resident,
through the runtime's `run_experts` on each path; `identical` compares the three outputs bit for
bit; `load picks` is the path the engine's load-time probe chooses on this device and dtype, and
`step runs` the one a step of that many tokens runs (`few` up to `FEW_TOKENS` of
`moe_runtime/layers/experts.py` on this device type: each expert on its own rows, no grouped
index work).
Command:

```bash
{cmd}
```

{table}
"""
