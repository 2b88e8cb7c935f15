"""``moeserve bench cpu-experts``: one expert computed by the CPU pool, against the read roof.

Hybrid expert execution (:mod:`moe_runtime.hybrid`) computes missed experts on the CPU from host
memory; at decode an expert meets few tokens, so its time is reading its weights once. For each
expert shape (hidden H, width I: ``bundled`` from the bundled checkpoint, the others from
:data:`moeserve.checkpoints.shapes.SHAPES`), format (``fp32``, ``bf16``: experts and activations
in that dtype; ``int8``: one scale per output channel; ``fp8``: e4m3 with 128 x 128 block scales;
``mxfp4``: e2m1 with a power-of-two scale per 32; activations fp32 for all three) and kernel
(:mod:`moe_runtime.hybrid.kernel_choice`: ``linear`` for the float formats and ``bf16-gemv`` for
bf16; ``dequant``, ``int8-gemv`` and ``int8pack`` for int8; ``dequant`` and ``fp8-gemv`` or
``mxfp4-gemv`` for fp8 and mxfp4), a host store of random experts (seeded; enough of them that
each call reads its weights from memory, not the cache, the pool at least
``--pool-mib``) runs one expert's projections and SwiGLU on ``T`` token rows through the
runtime's executor (:class:`~moe_runtime.hybrid.executor.CPUExpertExecutor`): the expert split by
ranges of output rows over ``--threads`` pool threads (each one OpenMP thread), its ranges at
least ``--min-unit-kib`` of weights, as the runtime runs it. A row is a warm-up round and
``--repeats`` timed rounds of ``--calls`` calls (more where that takes under
:data:`MIN_ROUND_S`): per call, the median round's time and the spread (the fastest and slowest
round's), the weights read per second (GB/s, 1e9 bytes), GFLOP/s (``2 x 3 x I x H x T``) and the
ranges per projection (gate/up + down; 1 + 1: whole).

The read roof is measured just before each timed round (so both see the same load on a shared
host): each of the ``--threads`` threads sums its own contiguous ``--roof-mib`` fp32 tensor
(``torch.sum``) at once; a row's roof is the median of its rounds' and its ``roof %`` its GB/s
over that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import threading
import time
from typing import Any

import torch

from moe_runtime.errors import ConfigError

FORMATS = ("fp32", "bf16", "int8", "fp8", "mxfp4")
DEFAULT_SHAPES = "bundled,olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b"
MiB = 1 << 20
#: a timed round makes at least ``--calls`` calls per thread and lasts at least this long (so a
#: scheduler tick on the shared host is a small part of it)
MIN_ROUND_S = 0.1


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cpu-experts", help="one expert on host threads by shape, tokens and format vs the read roof"
    )
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list (default: {DEFAULT_SHAPES})")
    p.add_argument("--tokens", default="1,2,4,8,32", help="comma list of token rows (default: 1,2,4,8,32)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of fp32, bf16, int8, fp8, mxfp4")
    p.add_argument(
        "--threads", type=int, default=1, help="pool threads, each expert split over all (default: 1)"
    )
    p.add_argument(
        "--min-unit-kib",
        type=int,
        default=None,
        help="least KiB of weights in one range of a split projection (default: the runtime's)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, >= 3 (default: 3)")
    p.add_argument("--calls", type=int, default=3, help="calls per thread and round (default: 3)")
    p.add_argument(
        "--pool-mib", type=int, default=256, help="least MiB of experts to cycle through (default: 256)"
    )
    p.add_argument(
        "--roof-mib", type=int, default=256, help="MiB each thread reads for the roof (default: 256)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def _in_threads(threads: int, work) -> float:
    """Run ``work(i)`` on ``threads`` threads at once (each with one OpenMP thread); wall seconds."""
    from moe_runtime.hybrid.executor import pool_thread_init

    barrier = threading.Barrier(threads + 1)

    def body(i: int) -> None:
        pool_thread_init()
        with torch.inference_mode():
            barrier.wait()
            work(i)
            barrier.wait()

    pool = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    barrier.wait()
    seconds = time.perf_counter() - t0
    for t in pool:
        t.join()
    return seconds


class ReadRoof:
    """The threads' read roof: each thread sums its own contiguous fp32 tensor of ``mib`` MiB
    (``torch.sum``, one OpenMP thread each), all at once."""

    def __init__(self, threads: int, mib: int) -> None:
        self.threads, self.nbytes = threads, mib * MiB
        self.data = [torch.ones(mib * MiB // 4) for _ in range(threads)]
        self.round()  # warm-up: the pages are touched

    def round(self) -> float:
        """GB/s of one round (all threads' bytes over its wall time)."""
        return self.threads * self.nbytes / _in_threads(self.threads, lambda i: self.data[i].sum()) / 1e9


def make_store(hidden: int, inter: int, fmt: str, pool_mib: int, seed: int) -> Any:
    """A host store of random experts in ``fmt``, as many as fill ``pool_mib`` MiB (at least 2)."""
    from moe_runtime.quant.fp8 import E4M3, Fp8BlockCodec, block_for
    from moe_runtime.quant.int8 import Int8ChannelCodec
    from moe_runtime.quant.layout import ExpertLayout
    from moe_runtime.quant.mxfp4 import Mxfp4Codec
    from moe_runtime.store import HostExpertStore

    codec = {
        "int8": Int8ChannelCodec,
        "fp8": lambda: Fp8BlockCodec(block_for(hidden, inter)),
        "mxfp4": Mxfp4Codec,
    }.get(fmt)
    layout = ExpertLayout(codec(), hidden, inter) if codec else None
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    nbytes = layout.nbytes if layout else 3 * hidden * inter * dtype.itemsize
    n = max(2, -(-pool_mib * MiB // nbytes))
    store = HostExpertStore(1, n, hidden, inter, dtype, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    if layout is None:
        for row in store.data:
            row.copy_(torch.randn(row.numel(), generator=gen).mul_(0.02))
        return store
    for part in ("gate", "up", "down"):
        if fmt == "mxfp4":  # random codes, one scale (2^-7) per group
            blocks = layout.view(store.data, part, "blocks")
            blocks.copy_(torch.randint(0, 256, blocks.shape, generator=gen, dtype=torch.uint8))
            layout.view(store.data, part, "scales").fill_(120)
            continue
        q = layout.view(store.data, part, "weight")
        if fmt == "fp8":  # normal random codes and one scale per block
            q.copy_(torch.randn(q.shape, generator=gen).mul_(100).to(E4M3))
            layout.view(store.data, part, "weight_scale_inv").fill_(0.02 / 100)
            continue
        q.copy_(torch.randint(-127, 128, q.shape, generator=gen, dtype=torch.int8))
        layout.view(store.data, part, "weight_scale").fill_(0.02 / 127)
    return store


def bench_kernel(
    executor: Any, kernel: Any, tokens: int, calls: int, repeats: int, seed: int, roof: ReadRoof
) -> tuple[float, float, float, float]:
    """Per-call seconds of ``kernel`` at ``tokens`` rows, one expert at a time on the executor's
    pool: (median, fastest repeat, slowest repeat) over ``repeats`` rounds after a warm-up round,
    and the median read roof (GB/s) of a roof round run just before each timed round."""
    store = executor.store
    n = store.num_experts
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, store.hidden_size, generator=gen).to(store.compute_dtype)
    cursor = 0
    n_calls = calls
    timed, roofs = [], []
    with torch.inference_mode():
        for r in range(repeats + 1):
            gbps = roof.round()
            t0 = time.perf_counter()
            each = []
            for c in range(n_calls):
                executor.run_one(kernel, (cursor + c) % n, x)
                each.append(time.perf_counter())
            seconds = (each[-1] - t0) / n_calls
            cursor += n_calls
            if r:
                timed.append(seconds)
                roofs.append(gbps)
            else:  # the warm-up round sizes the timed ones, at least MIN_ROUND_S each, by its
                # fastest call (its first one may load a compiled kernel)
                fastest = min(b - a for a, b in zip([t0, *each], each))
                n_calls = max(calls, math.ceil(MIN_ROUND_S / max(fastest, 1e-9)))
    return statistics.median(timed), min(timed), max(timed), statistics.median(roofs)


def _row(name: str, fmt: str, kernel: Any, t: int, times, executor: Any) -> dict:
    """One result row: ``times`` (median, min, max seconds; roof GB/s) as ms, GB/s, roof share,
    GFLOP/s, and the ranges per projection."""
    med, lo, hi, roof = times
    store = executor.store
    h, i = store.hidden_size, store.intermediate_size
    gbps = store.expert_nbytes / med / 1e9
    gu, down = executor.plans(kernel)
    return {
        "shape": name, "hidden": h, "intermediate": i, "format": fmt, "kernel": kernel.name,
        "exact": kernel.exact, "tokens": t, "ms": 1e3 * med, "ms_min": 1e3 * lo, "ms_max": 1e3 * hi,
        "expert_mib": store.expert_nbytes / MiB, "gbps": gbps, "roof_gbps": roof,
        "roof_pct": 100 * gbps / roof, "gflops": 6 * h * i * t / med / 1e9,
        "ranges": [len(gu), len(down)],
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from moe_runtime.host_alloc import keep_freed_memory
    from moe_runtime.hybrid.executor import MIN_UNIT_BYTES, CPUExpertExecutor
    from moe_runtime.hybrid.kernel_choice import _has_numba, eligible_kernels
    from moeserve.bench.experts import _cpu_name, _positive_ints, shape_of

    tokens = _positive_ints("--tokens", args.tokens)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    shapes = {name: shape_of(name)[:2] for name in names}  # unknown names fail before any work
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise ConfigError(f"--formats: {f!r} is not one of {', '.join(FORMATS)}")
    if args.repeats < 3:
        raise ConfigError(f"--repeats must be >= 3 (median and spread), got {args.repeats}")
    for flag, v in (("--threads", args.threads), ("--calls", args.calls), ("--pool-mib", args.pool_mib)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    if args.min_unit_kib is not None and args.min_unit_kib < 1:
        raise ConfigError(f"--min-unit-kib must be >= 1, got {args.min_unit_kib}")
    unit = MIN_UNIT_BYTES if args.min_unit_kib is None else args.min_unit_kib * 1024
    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine does: temporaries reuse freed heap (moe_runtime.host_alloc)
    roof = ReadRoof(args.threads, args.roof_mib)
    rows = []
    for name, (h, i) in shapes.items():
        for fmt in formats:
            store = make_store(h, i, fmt, args.pool_mib, args.seed)
            executor = CPUExpertExecutor(store, None, args.threads, unit)
            kernels = eligible_kernels(store)
            executor.check_split(kernels)
            try:
                for kernel in kernels:
                    for t in tokens:
                        times = bench_kernel(executor, kernel, t, args.calls, args.repeats, args.seed, roof)
                        rows.append(_row(name, fmt, kernel, t, times, executor))
            finally:
                executor.close()
            del store, executor
    settings = {
        "cpu": _cpu_name(),
        "threads": args.threads,
        "omp_threads_per_thread": 1,
        "min_unit_bytes": unit,
        "repeats": args.repeats,
        "calls": args.calls,
        "warmup": "1 round",
        "pool_mib": args.pool_mib,
        "roof": f"each of the threads sums its own {args.roof_mib} MiB fp32 tensor at once just before each "
        "timed round; "
        "a row's roof is the median of its rounds'",
        "roof_gbps_median": round(statistics.median(r["roof_gbps"] for r in rows), 2) if rows else None,
        "load_avg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "numba": _has_numba(),
        "torch": torch.__version__,
    }
    data = {"settings": settings, "results": rows}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render(data)
    return 0


def render(data: dict[str, Any]) -> None:
    """Print the settings, then the results as a table."""
    from richconsole import Table, make_console

    s = data["settings"]
    console = make_console()
    console.print("\n".join(f"{k}: {v}" for k, v in s.items()))
    table = Table(
        "shape", "format", "kernel", "tokens", "ms (min-max)", "GB/s", "roof GB/s", "roof %", "GFLOP/s",
        "ranges", title=f"CPU expert time, one expert over {s['threads']} thread(s)",
    )  # fmt: skip
    for r in data["results"]:
        table.add_row(
            r["shape"], r["format"], r["kernel"] + ("" if r["exact"] else "*"), str(r["tokens"]),
            f"{r['ms']:.3f} ({r['ms_min']:.3f}-{r['ms_max']:.3f})", f"{r['gbps']:.1f}",
            f"{r['roof_gbps']:.1f}", f"{r['roof_pct']:.0f}", f"{r['gflops']:.1f}",
            "+".join(map(str, r["ranges"])),
        )  # fmt: skip
    console.print(table)
    console.print("* not exact for the compute dtype (eligible where the experts are stored in its format)")


def markdown(data: dict[str, Any]) -> str:
    """The results as a Markdown table with the settings line (for a generated docs block)."""
    from moeserve.bench.render import md_table

    s = data["settings"]
    header = ["shape", "format", "kernel", "tokens", "ms [min-max]", "GB/s", "roof GB/s", "roof %", "GFLOP/s"]
    rows = [
        [r["shape"], r["format"], r["kernel"], str(r["tokens"]),
         f"{r['ms']:.3f} [{r['ms_min']:.3f}-{r['ms_max']:.3f}]", f"{r['gbps']:.1f}",
         f"{r['roof_gbps']:.1f}", f"{r['roof_pct']:.0f}", f"{r['gflops']:.1f}"]
        for r in data["results"]
    ]  # fmt: skip
    settings = ", ".join(f"`{k}={v}`" for k, v in s.items() if k != "roof")
    return (
        f"One expert at a time over {s['threads']} pool thread(s); the roof is the same threads' read rate "
        f"measured just before each round.\n\n{md_table(header, rows)}\nSettings: {settings}\n"
    )
