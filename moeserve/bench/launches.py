"""``moeserve bench launches``: ops, kernel launches and host syncs per decoder layer of a decode step.

A decode step's host time is the floor of its latency on a GPU, unless the step replays a CUDA
graph (``moe_runtime.engine.decode_graphs``; ``--enforce-eager`` measures the eager steps): every
aten op the model runs is Python and dispatcher work, and every op that computes something
launches at least one kernel.
This bench counts, over the model's whole forward pass of decode steps (embedding, every decoder
layer, final norm, LM head; sampling is not counted), at each ``--batches`` size:

* On the CPU: **aten ops** and the **launching ops** among them (not a view or alias of its
  input), with a ``TorchDispatchMode`` (:class:`OpCounter`): the CPU-checkable proxy for kernel
  launches that ``tests/test_op_counts.py`` bounds.
* On the CPU with ``--compile-decode`` (``moe_runtime.engine.compiled_decode``, as ``moeserve
  serve`` runs steps whose experts are all resident), with ``torch.profiler``: the **kernel calls**
  of a step, each generated C++ loop of the compiled forward and each library call it makes
  (``mm``, SDPA, ``topk``), plus the aten ops the step runs outside the compiled forward. A dispatch
  mode sees only the library calls, not the generated loops, so it cannot count these steps.
* On CUDA, with ``torch.profiler``: the **kernel launches** the host issued (runtime calls
  ``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaGraphLaunch`` ...), the **kernels** the GPU ran,
  the host **syncs** (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``
  and synchronous ``cudaMemcpy``), and the **GPU busy share**: the kernels' summed time over the
  step's wall time under the profiler (the profiler adds host time, so the share is a lower bound),
  and the host events that took the most time in one step (``host_top``: name, calls, us).

Figures are per decode step divided by the model's decoder layers, the median over the timed steps
of one run after a warm-up run (the counts do not vary between steps of one batch; the busy share
does, and gets its min-max spread). All experts are resident unless ``--buffer-fraction`` < 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LAUNCH_CALLS = ("LaunchKernel", "cuLaunch", "GraphLaunch", "LaunchCooperativeKernel")
SYNC_CALLS = ("Synchronize", "cudaMemcpy")  # cudaMemcpy without Async waits for the copy
TOP_HOST = 15  # host events by self time listed for one profiled step (``host_top``)
STEP_RANGE = "moeserve.decode_step"  # the profiler range around the counted forward
COPY_ACTIVITIES = ("Memcpy", "Memset")  # device activities that are copies, not kernels
SHOWN_HOST = 8  # of them, rendered in the docs


def _storage(t: Any) -> int | None:
    t = t[0] if isinstance(t, (list, tuple)) and t else t
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


class OpCounter(TorchDispatchMode):
    """Counts every aten op (``ops``) and the ops that run a kernel (``launches``): all but a
    view, i.e. an op whose schema returns an alias of its input that it does not write and whose
    result shares the input's storage (``view``, ``slice``, ``unbind``; a ``to`` that casts is a
    launch, one that returns its input is not). Not on CUDA: the compiled FlexAttention of paged
    decode refuses to run under a dispatch mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        ret = func._schema.returns
        alias = ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write
        if not (alias and args and _storage(out) is not None and _storage(out) == _storage(args[0])):
            self.launches += 1
        return out


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_compile_decode_arg, add_load_format_arg, add_model_arg

    p = sub.add_parser(
        "launches", help="aten ops, CUDA kernel launches and host syncs per decoder layer per step"
    )
    add_model_arg(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    add_load_format_arg(p)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    p.add_argument("--buffer-fraction", type=float, default=1.0, help="share of experts in slots (1 = all)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=6, help="tokens per sequence; decode steps = this - 1")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="no decode CUDA graphs")
    add_compile_decode_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run)


COMPILED_CALL = "## Call CompiledFxGraph"  # the profiler's event for one run of a compiled graph
COMPILED_REGION = "Torch-Compiled Region"


def kernel_calls(events: list[Any]) -> tuple[int, int, int]:
    """``(kernel calls, generated kernels among them, aten ops outside compiled regions among
    them)`` of one profiled step: each child of a compiled graph's run (a generated loop, seen when
    the graph was compiled with ``cpp.enable_kernel_profile`` as ``CompiledDecode`` compiles it, or
    a library call such as ``aten::mm``), plus each outermost aten op outside a compiled region
    (eager work around the compiled forward, or a whole eager step)."""
    calls = generated = outside = 0
    for e in events:
        if e.name.startswith(COMPILED_CALL):
            calls += len(e.cpu_children)
            generated += sum(1 for c in e.cpu_children if not c.name.startswith("aten::"))
        elif e.name.startswith("aten::"):
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith(("aten::", COMPILED_REGION)):
                parent = parent.cpu_parent
            outside += parent is None
    return calls + outside, generated, outside


def _profile_step(forward, cuda: bool) -> tuple[Any, dict[str, Any]]:
    """``forward()`` under ``torch.profiler``: launches, kernels, syncs, busy share (CUDA),
    kernel calls (:func:`kernel_calls`; any device), the step's profiled wall time and its top
    host events. Host events count only inside the forward's range on its own thread (not the
    bench's closing synchronise, nor the I/O and CPU expert threads' work); device events only
    where they are kernels (not copies)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        with record_function(STEP_RANGE):
            out = forward()
        sync()  # the step's kernels are in the trace
    events = prof.events()
    step = next(e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU)
    t0, t1 = step.time_range.start, step.time_range.end
    host = [
        e
        for e in events
        if e.device_type == DeviceType.CPU
        and e is not step
        and e.thread == step.thread
        and t0 <= e.time_range.start <= t1
    ]
    kernels = [
        e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(COPY_ACTIVITIES)
    ]
    wall = t1 - t0
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    launches = sum(1 for e in host if any(c in e.name for c in LAUNCH_CALLS))
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_HOST]
    syncs = sum(1 for e in host if any(c in e.name for c in SYNC_CALLS) and not e.name.endswith("Async"))
    calls, generated, outside = kernel_calls(host)
    return out, {
        "launches": launches,
        "kernels": len(kernels),
        "syncs": syncs,
        "kernel_calls": calls,
        "generated_kernels": generated,
        "eager_ops": outside,
        "busy_share": busy / max(wall, 1),
        "wall_us": wall,
        "host_top": [[a.key, a.count, round(a.self_cpu_time_total, 1)] for a in top],
    }


def measure(engine, batch: int, args: argparse.Namespace, profiled_run: bool | None = None) -> dict[str, Any]:
    """One row: the counts of ``batch`` sequences' decode steps (see the module docstring);
    ``profiled_run``: profile instead of counting aten ops (default: on CUDA, where decode steps
    run compiled, or wherever FlexAttention decodes)."""
    from moe_runtime.engine.request import SamplingParams

    layers = engine.loaded.config.num_layers
    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.loaded.config.vocab_size
    prompts = torch.randint(5, vocab, (batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up: caches, allocator, the kernels' first launches
    # the engine's forward: from a decode CUDA graph where one applies (``engine.graphs``), else eager
    forward, cuda = engine._forward, engine.model.device.type == "cuda"  # noqa: SLF001
    # FlexAttention (CUDA's paged decode) refuses to run under the op counter's dispatch mode
    flex = getattr(engine.kv, "flex", None) is not None
    compiled = engine.compiled is not None and engine.compiled.enabled
    profiled_run = (cuda or flex or compiled) if profiled_run is None else profiled_run
    steps: list[dict[str, float]] = []

    def counted(ids, step, *rest, **kw):
        if not step.all_decode:
            return forward(ids, step, *rest, **kw)
        with OpCounter() as c:
            out = forward(ids, step, *rest, **kw)
        steps.append({"ops": c.ops, "launching_ops": c.launches})
        return out

    def profiled(ids, step, *rest, **kw):
        if not step.all_decode:
            return forward(ids, step, *rest, **kw)
        out, row = _profile_step(lambda: forward(ids, step, *rest, **kw), cuda)
        profiles.append(row)
        return out

    profiles: list[dict[str, float]] = []
    compiled_before = engine.compiled.steps if compiled else 0
    try:
        engine._forward = profiled if profiled_run else counted  # noqa: SLF001
        engine.generate(prompts, params)
    finally:
        del engine._forward  # the method again
    row: dict[str, Any] = {"batch": batch, "decode_steps": len(steps or profiles), "decoder_layers": layers}
    if compiled:
        row["compiled_steps"] = engine.compiled.steps - compiled_before
    for key in ("ops", "launching_ops") if steps else ():
        row[f"{key}_per_layer"] = statistics.median(s[key] for s in steps) / layers
    if profiles:
        for key in ("launches", "kernels", "syncs", "kernel_calls", "generated_kernels", "eager_ops"):
            row[f"{key}_per_step"] = statistics.median(p[key] for p in profiles)
            row[f"{key}_per_layer"] = row[f"{key}_per_step"] / layers
        shares = [p["busy_share"] for p in profiles]
        row["gpu_busy_share"] = statistics.median(shares)
        row["gpu_busy_share_spread"] = [min(shares), max(shares)]
        row["profiled_step_us"] = statistics.median(p["wall_us"] for p in profiles)
        # host events by self time (name, calls, microseconds) of the median-length profiled step
        row["host_top"] = sorted(profiles, key=lambda p: p["wall_us"])[len(profiles) // 2]["host_top"]
    return row


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.errors import ConfigError
    from moeserve.commands.common import resolve_model

    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ConfigError(f"--batches {args.batches!r}: not integers") from None
    if args.new_tokens < 2:
        raise ConfigError(f"--new-tokens {args.new_tokens}: must be >= 2 (one decode step)")
    torch.set_num_threads(args.cpu_threads)
    model_dir = resolve_model(args)
    settings = {
        "model": str(model_dir.name),
        "device": args.device,
        "dtype": args.dtype,
        "buffer_fraction": args.buffer_fraction,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "cpu_threads": args.cpu_threads,
        "cuda_graphs": args.device.startswith("cuda") and not args.enforce_eager,
        "compile_decode": args.compile_decode,
        "load_format": args.load_format,
        "expert_compute": "device",
        "torch": torch.__version__,
    }
    if args.device.startswith("cuda"):
        settings["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    rows = []
    for batch in batches:
        runtime = RuntimeConfig(
            device=args.device,
            dtype=args.dtype,
            max_batch_size=batch,
            max_model_len=args.prompt_len + args.new_tokens + 8,
            cpu_threads=args.cpu_threads,
            buffer_fraction=None if args.buffer_fraction >= 1 else args.buffer_fraction,
            cuda_graphs=not args.enforce_eager,
            compile_decode=args.compile_decode,
            load_format=args.load_format,
            expert_compute="device",  # missed experts copied: no CPU expert threads in the counts
        )
        with LLMEngine.from_pretrained(model_dir, runtime) as engine:
            if engine.compiled is not None:  # every variant compiled before the counted steps
                engine.capture_graphs()
            rows.append(measure(engine, batch, args))
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}, indent=1))
        return 0
    print("  ".join(f"{k}={v}" for k, v in settings.items()))
    for row in rows:
        print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


def render(data: dict[str, Any]) -> str:
    """Markdown of a ``--json`` result: one row per batch size, then the top host events of the
    first row's profiled step (CUDA, or compiled CPU steps)."""
    rows = data["rows"]
    cuda = rows[0].get("kernels_per_step", 0) > 0
    compiled = not cuda and bool(data["settings"].get("compile_decode"))
    if cuda:
        head = "| batch | kernel launches / layer | kernels / layer | host syncs / step | GPU busy share |"
        lines = [head + " profiled step ms |", "|---|---|---|---|---|---|"]
        for r in rows:
            lo, hi = r["gpu_busy_share_spread"]
            lines.append(
                f"| {r['batch']} | {r['launches_per_layer']:.1f} | {r['kernels_per_layer']:.1f} | "
                f"{r['syncs_per_step']:.0f} | {r['gpu_busy_share']:.1%} ({lo:.1%}-{hi:.1%}) | "
                f"{r['profiled_step_us'] / 1e3:.2f} |"
            )
    elif compiled:
        lines = ["| batch | kernel calls / layer | decode steps (compiled) | profiled step ms |"]
        lines.append("|---|---|---|---|")
        lines += [
            f"| {r['batch']} | {r['kernel_calls_per_layer']:.2f} | {r['decode_steps']} "
            f"({r.get('compiled_steps', 0)}) | {r['profiled_step_us'] / 1e3:.2f} |"
            for r in rows
        ]
    else:
        lines = ["| batch | aten ops / layer | launching ops / layer |", "|---|---|---|"]
        lines += [
            f"| {r['batch']} | {r['ops_per_layer']:.2f} | {r['launching_ops_per_layer']:.2f} |" for r in rows
        ]
    if cuda or compiled:
        lines += ["", f"Host events by self time in one profiled step at batch {rows[0]['batch']}:", ""]
        lines += ["| event | calls | self us |", "|---|---|---|"]
        top = rows[0]["host_top"][:SHOWN_HOST]
        lines += [f"| `{name[:60]}` | {calls} | {us:.0f} |" for name, calls, us in top]
    settings = ", ".join(f"`{k}={v}`" for k, v in data["settings"].items())
    return "\n".join(lines) + f"\n\nSettings: {settings}"
