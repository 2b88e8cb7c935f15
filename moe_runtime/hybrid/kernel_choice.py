"""Which CPU kernel runs a host store's experts: the eligible kernels by format, each measured at
load on the store's own experts, the fastest kept per row count (named with its GB/s in the load
summary). The kernels themselves: :mod:`moe_runtime.hybrid.cpu_kernels` (the torch ones) and
:mod:`moe_runtime.hybrid.gemv` (the compiled ones)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe_runtime.hybrid.cpu_kernels import (
    CastLinear,
    Dequant,
    Int8Pack,
    Kernel,
    Linear,
    _silu_glu,
    run_projections,
)
from moe_runtime.hybrid.gemv import Bf16Gemv, Fp8Gemv, Int8Gemv, e4m3_exact
from moe_runtime.hybrid.mxfp4_gemv import Mxfp4Gemv, mxfp4_exact

#: token rows at which the kernels are measured at load; a step's row count uses the nearest
ROW_POINTS = (1, 4, 32)
_FLOAT_CODECS = ("bf16", "fp16", "fp32")


def _has_numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:  # pragma: no cover - numba is a dependency
        return False
    return True


def eligible_kernels(store: Any) -> list[Kernel]:
    """The kernels that may run ``store``'s experts, the exact one first (see the module note)."""
    layout = store.layout
    if layout is None:
        bf16 = store.compute_dtype == torch.bfloat16 and _has_numba()
        return [Linear(store), *([Bf16Gemv(store)] if bf16 else [])]
    name = layout.codec.name
    kernels: list[Kernel] = [Dequant(store)]
    if name in _FLOAT_CODECS:
        kernels.append(CastLinear(store))
        if name == "bf16" and _has_numba():
            kernels.append(Bf16Gemv(store))
    elif name == "fp8":
        if _has_numba() and e4m3_exact():  # a thread that flushes subnormals would zero some
            kernels.append(Fp8Gemv(store))
    elif name == "mxfp4":
        if _has_numba() and mxfp4_exact():
            kernels.append(Mxfp4Gemv(store))
    elif name == "int8":
        if _has_numba():
            kernels.append(Int8Gemv(store))
        if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            kernels.append(Int8Pack(store))
    return kernels


@dataclass
class KernelChoice:
    """The kernel per measured row count (:data:`ROW_POINTS`) and the measured seconds.

    Attributes:
        points: the row counts measured. kernels: the fastest kernel at each.
        seconds: ``{kernel name: [seconds per expert at each point]}`` (medians).
        expert_nbytes: bytes of one stored expert (its GB/s at one row: ``expert_nbytes / s``).
    """

    points: tuple[int, ...]
    kernels: list[Kernel]
    seconds: dict[str, list[float]]
    expert_nbytes: int

    def for_rows(self, rows: int) -> Kernel:
        """The kernel measured fastest at the point nearest ``rows`` (log scale)."""
        best = min(range(len(self.points)), key=lambda i: abs(np.log(max(rows, 1) / self.points[i])))
        return self.kernels[best]

    @property
    def seconds_chosen(self) -> list[float]:
        """Seconds per expert of the chosen kernel at each point."""
        return [self.seconds[k.name][i] for i, k in enumerate(self.kernels)]

    def gbps(self) -> float:
        """Weights read per second at one row by the kernel chosen there, GB/s (1e9 bytes)."""
        return self.expert_nbytes / self.seconds_chosen[0] / 1e9

    def describe(self) -> str:
        """``int8-gemv (1 row, 18.2 GB/s), int8pack from 32 rows``: the choice, for the summary."""
        first = f"{self.kernels[0].name} ({self.gbps():.1f} GB/s at 1 row)"
        rest = [
            f"{k.name} from {p} rows"
            for i, (p, k) in enumerate(zip(self.points, self.kernels))
            if i and k is not self.kernels[i - 1]
        ]
        return ", ".join([first, *rest])


def choose_kernels(
    store: Any,
    points: tuple[int, ...] = ROW_POINTS,
    repeats: int = 3,
    budget_s: float = 0.5,
    kernels: list[Kernel] | None = None,
    run: Callable[[Kernel, int, torch.Tensor], Any] | None = None,
) -> KernelChoice:
    """Measure each eligible kernel (:func:`eligible_kernels`) at each row count of ``points`` on
    the store's own experts (a different expert per call, so weights come from memory, not the
    cache; median of ``repeats`` after a warm-up) and keep the fastest per point; a kernel that
    is not exact must beat the exact one. ``budget_s``: stop repeating a kernel's point once its
    calls took this long (large experts). ``run(kernel, key, x)`` computes one expert (default:
    :func:`run_projections` on the calling thread; the runtime passes its pool's, so the times
    are every pool thread's on one expert)."""
    kernels = kernels or eligible_kernels(store)
    if run is None:
        run = lambda k, key, x: run_projections(k, key, x, _silu_glu)  # noqa: E731
    n_keys = store.num_layers * store.num_experts
    gen = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {}
    key = 0
    with torch.inference_mode():
        for k in kernels:
            seconds[k.name] = []
            for rows in points:
                x = torch.randn(rows, store.hidden_size, generator=gen).to(store.compute_dtype)
                times: list[float] = []
                spent = 0.0
                for i in range(repeats + 1):
                    expert = key % n_keys
                    key += 7  # a different expert each call (another layer's, most often)
                    t0 = time.perf_counter()
                    run(k, expert, x)
                    dt = time.perf_counter() - t0
                    spent += dt
                    if i:  # the first call warms up
                        times.append(dt)
                    if spent > budget_s and times:
                        break
                seconds[k.name].append(statistics.median(times))
    chosen = [fastest(kernels, seconds, j) for j in range(len(points))]
    return KernelChoice(tuple(points), chosen, seconds, store.expert_nbytes)


def fastest(kernels: list[Kernel], seconds: dict[str, list[float]], j: int) -> Kernel:
    """The kernel with the fewest ``seconds`` at point ``j`` (``seconds[name][j]``); on a tie the
    exact one, so a kernel that is not exact must beat it to be chosen."""
    return min(kernels, key=lambda k: (seconds[k.name][j], not k.exact))
