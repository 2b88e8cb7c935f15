"""CPU kernels for one expert read straight from its host-store row, and the choice among them.

An expert's row in the host store (:class:`~moe_runtime.store.HostExpertStore`) is
``[gate | up | down]`` in the compute dtype, or a quantized expert's packed bytes
(:mod:`moe_runtime.quant.layout`). A kernel computes ``gate_up(row, x) -> [n, 2I]`` and
``down(row, h) -> [n, H]``; the activation and any biases between them are the device path's
own (``moe_runtime.layers.experts``), so only the two projections differ from it.

Kernels (``exact`` ones give the device path's bits on a CPU device; a kernel that is not exact
is eligible only where the experts are stored in its own format, e.g. int8 experts):

* ``linear`` (exact): ``F.linear`` on views of a plain row, as the device path runs a slot.
* ``dequant`` (exact): the quantized row dequantized to the compute dtype, then ``F.linear``, as
  the device path's dequantizing slot views do (fp8, MXFP4, int8 and cast experts).
* ``cast-linear``: float experts stored in another dtype than the compute dtype (``--expert-dtype
  bf16`` with ``--dtype fp32``): ``F.linear`` in the stored dtype, the output cast back.
* ``int8-gemv``: int8 experts, one scale per output channel: a compiled loop (numba, ``nogil``,
  :mod:`moe_runtime.hybrid.gemv`) over the int8 rows with fp32 accumulators, scaled per
  row, four row streams at once; reads 1 byte per weight. An unsplit expert with the plain
  SwiGLU runs whole in one call (``swiglu``).
* ``bf16-gemv``: bf16 experts (a bf16 model's, or ``--expert-dtype bf16``): the same loop on the
  bf16 rows, each weight widened to fp32 exactly; reads 2 bytes per weight. oneDNN's bf16
  ``F.linear`` at one token read a third of this host's roof.
* ``int8pack``: int8 experts through ``torch.ops.aten._weight_int8pack_mm`` (activations in bf16
  unless the compute dtype is bf16 or fp16).

fp8 and MXFP4 experts run ``dequant`` (no second copy of the store is made: see docs/hybrid.md).
:func:`choose_kernels` measures the eligible kernels at load on the store's own experts and keeps
the fastest per row count.

Each kernel also computes a range of a projection's output rows (``gate_up_rows``, ``down_rows``):
the executor splits one expert over every pool thread that way, as llama.cpp and KTransformers
split a matrix product's rows over their threads. A range is the same product on fewer weight
rows, so each output element's dot product is the whole product's where the range starts at a
multiple of :data:`ROW_ALIGN` (the executor checks this per kernel at load and runs a kernel whose
ranges differ whole). fp8's block scales span rows: its ``dequant`` runs whole.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moe_runtime.hybrid.gemv import gemv_rows, gemv_swiglu

#: token rows at which the kernels are measured at load; a step's row count uses the nearest
ROW_POINTS = (1, 4, 32)
#: a range of output rows starts at a multiple of this: on this host's MKL sgemm and oneDNN a
#: product split at 16-row boundaries gives the whole product's bits for 1-32 token rows, where
#: 8-row boundaries did not (fp32, 4+ rows); 16 fp32 values are one AVX-512 register
ROW_ALIGN = 16
_FLOAT_CODECS = ("bf16", "fp16", "fp32")


def _has_numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:  # pragma: no cover - numba is a dependency
        return False
    return True


def gate_up_pieces(inter: int, r0: int, r1: int) -> list[tuple[str, int, int]]:
    """Rows ``[r0, r1)`` of the fused ``[gate | up]`` product (``2 x inter`` rows) as
    ``(part, first, end)`` rows of the ``gate`` and ``up`` matrices."""
    out = []
    if r0 < inter:
        out.append(("gate", r0, min(r1, inter)))
    if r1 > inter:
        out.append(("up", max(r0, inter) - inter, r1 - inter))
    return out


class Kernel:
    """One way to run an expert's two projections from its host row.

    Args: store: the host expert store (its rows, layout and dtypes). Attributes: name; exact;
    splits (the projections run by ranges of output rows: ``gate_up_rows``, ``down_rows``).
    Every method takes the expert's flat key (``layer * E + expert``)."""

    name = ""
    exact = True
    splits = True
    fused = False  # has :meth:`swiglu`, the whole expert in one call

    def __init__(self, store: Any) -> None:
        self.store = store
        self.layout = store.layout
        self.dtype = store.compute_dtype
        self.h, self.i = store.hidden_size, store.intermediate_size

    def gate_up(self, key: int, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """``x [n, H]`` (compute dtype) -> ``[n, 2I]``, ``[gate | up]`` (compute dtype)."""
        raise NotImplementedError

    def down(self, key: int, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """``h [n, I]`` (compute dtype) -> ``[n, H]`` (compute dtype)."""
        raise NotImplementedError

    def gate_up_rows(self, key: int, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:  # pragma: no cover
        """Columns ``r0:r1`` of :meth:`gate_up`'s output, ``[n, r1 - r0]``."""
        raise NotImplementedError

    def down_rows(self, key: int, h: torch.Tensor, r0: int, r1: int) -> torch.Tensor:  # pragma: no cover
        """Columns ``r0:r1`` of :meth:`down`'s output, ``[n, r1 - r0]``."""
        raise NotImplementedError

    def swiglu(self, key: int, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """The whole expert with the plain SwiGLU and no biases, ``x [n, H] -> [n, H]`` (compute
        dtype), in one call (kernels with :attr:`fused` only)."""
        raise NotImplementedError


class Linear(Kernel):
    name = "linear"

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        # every expert's two matrices as strided views of the store, made once: a range is then
        # one index and one slice (a unit's Python is on the GIL while the pool's threads wait)
        at = 2 * self.i * self.h
        self._gu = store.data[:, :at].view(-1, 2 * self.i, self.h)
        self._down = store.data[:, at:].view(-1, self.h, self.i)

    def gate_up_rows(self, key, x, r0, r1):
        return F.linear(x, self._gu[key][r0:r1])

    def down_rows(self, key, h, r0, r1):
        return F.linear(h, self._down[key][r0:r1])

    def gate_up(self, key, x):
        return self.gate_up_rows(key, x, 0, 2 * self.i)

    def down(self, key, h):
        return self.down_rows(key, h, 0, self.h)


class Dequant(Kernel):
    name = "dequant"

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.splits = bool(self.layout.codec.row_scaled)  # fp8's block scales span rows

    def _rows(self, key: int, part: str, a: int, b: int) -> torch.Tensor:
        lay, row = self.layout, self.store.expert(key)
        comps = {n: lay.view(row, part, n)[a:b] for n in lay.component_names}
        return lay.codec.dequantize(comps, b - a, lay.shape(part)[1], self.dtype)

    def gate_up(self, key, x):
        return F.linear(x, self.layout.gate_up(self.store.expert(key), self.dtype))

    def down(self, key, h):
        return F.linear(h, self.layout.dequant(self.store.expert(key), "down", self.dtype))

    def gate_up_rows(self, key, x, r0, r1):
        ws = [self._rows(key, p, a, b) for p, a, b in gate_up_pieces(self.i, r0, r1)]
        return F.linear(x, ws[0] if len(ws) == 1 else torch.cat(ws))

    def down_rows(self, key, h, r0, r1):
        return F.linear(h, self._rows(key, "down", r0, r1))


class CastLinear(Kernel):
    name = "cast-linear"
    exact = False

    def _w(self, key: int, part: str) -> torch.Tensor:
        return self.layout.view(self.store.expert(key), part, "weight")

    def gate_up(self, key, x):
        xs = x.to(self.layout.codec.dtype)
        out = torch.cat([F.linear(xs, self._w(key, "gate")), F.linear(xs, self._w(key, "up"))], dim=-1)
        return out.to(self.dtype)

    def down(self, key, h):
        return F.linear(h.to(self.layout.codec.dtype), self._w(key, "down")).to(self.dtype)

    def gate_up_rows(self, key, x, r0, r1):
        xs = x.to(self.layout.codec.dtype)
        outs = [F.linear(xs, self._w(key, p)[a:b]) for p, a, b in gate_up_pieces(self.i, r0, r1)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(self.dtype)

    def down_rows(self, key, h, r0, r1):
        return F.linear(h.to(self.layout.codec.dtype), self._w(key, "down")[r0:r1]).to(self.dtype)


class Gemv(Kernel):
    """The compiled row-stream loops of :mod:`moe_runtime.hybrid.gemv` on the stored weights,
    fp32 accumulators; subclasses give every expert's ``[keys, N, K]`` weights per part
    (:meth:`_weights`) and their per-row scales (None: unscaled)."""

    exact = False
    fused = True

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        # numpy views of every expert's components, made once: a call only indexes them by key
        self._q, self._s = self._weights(store)

    def _weights(
        self, store: Any
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray | None]]:  # pragma: no cover
        raise NotImplementedError

    def _call(self, x: torch.Tensor, width: int, fill) -> torch.Tensor:
        """``fill(xs, out)`` on ``x [n, K]`` as fp32 numpy and a fresh fp32 ``out [n, width]``;
        ``out`` in the compute dtype."""
        xs = x.to(torch.float32).contiguous().numpy()
        out = np.empty((xs.shape[0], width), dtype=np.float32)
        fill(xs, out)
        y = torch.from_numpy(out)
        return y if self.dtype == torch.float32 else y.to(self.dtype)

    def _run(self, key: int, x: torch.Tensor, pieces, width: int) -> torch.Tensor:
        """``pieces``: ``(part, first, end)`` weight rows, their outputs side by side (``width``)."""

        def fill(xs, out):
            col = 0
            for part, a, b in pieces:
                s = self._s[part]
                gemv_rows(self._q[part][key][a:b], None if s is None else s[key][a:b], xs, out, col)
                col += b - a

        return self._call(x, width, fill)

    def gate_up(self, key, x):
        return self._run(key, x, (("gate", 0, self.i), ("up", 0, self.i)), 2 * self.i)

    def down(self, key, h):
        return self._run(key, h, (("down", 0, self.h),), self.h)

    def gate_up_rows(self, key, x, r0, r1):
        return self._run(key, x, gate_up_pieces(self.i, r0, r1), r1 - r0)

    def down_rows(self, key, h, r0, r1):
        return self._run(key, h, (("down", r0, r1),), r1 - r0)

    def swiglu(self, key, x):
        parts = [q[key] for q in (self._q["gate"], self._q["up"], self._q["down"])]
        scales = [None if s is None else s[key] for s in (self._s["gate"], self._s["up"], self._s["down"])]
        args = [a for pair in zip(parts, scales) for a in pair]
        return self._call(x, self.h, lambda xs, out: gemv_swiglu(*args, xs, out))


class Int8Gemv(Gemv):
    """int8 experts, one scale per output row: 1 byte read per weight."""

    name = "int8-gemv"

    def _weights(self, store):
        lay, data = self.layout, store.data
        q = {p: lay.view(data, p, "weight").numpy() for p in ("gate", "up", "down")}
        return q, {p: lay.view(data, p, "weight_scale").numpy() for p in ("gate", "up", "down")}


class Bf16Gemv(Gemv):
    """bf16 experts (a bf16 model's plain rows, or ``--expert-dtype bf16``): 2 bytes read per
    weight, each widened to fp32 exactly; the output is rounded once, to the compute dtype."""

    name = "bf16-gemv"

    def _weights(self, store):
        if self.layout is None:  # a plain [gate | up | down] row
            h, i, data = self.h, self.i, store.data.view(torch.int16)
            q = {
                "gate": data[:, : i * h].view(-1, i, h),
                "up": data[:, i * h : 2 * i * h].view(-1, i, h),
                "down": data[:, 2 * i * h :].view(-1, h, i),
            }
        else:
            q = {
                p: self.layout.view(store.data, p, "weight").view(torch.int16) for p in ("gate", "up", "down")
            }
        return {p: w.numpy() for p, w in q.items()}, {"gate": None, "up": None, "down": None}


class Int8Pack(Kernel):
    name = "int8pack"
    exact = False

    def _mm(self, key: int, x: torch.Tensor, part: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        act = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        row = self.store.expert(key)
        q = self.layout.view(row, part, "weight")[a:b]
        scale = self.layout.view(row, part, "weight_scale")[a:b].reshape(-1).to(act)
        return torch.ops.aten._weight_int8pack_mm(x.to(act), q, scale)

    def gate_up(self, key, x):
        return torch.cat([self._mm(key, x, "gate"), self._mm(key, x, "up")], dim=-1).to(self.dtype)

    def down(self, key, h):
        return self._mm(key, h, "down").to(self.dtype)

    def gate_up_rows(self, key, x, r0, r1):
        outs = [self._mm(key, x, p, a, b) for p, a, b in gate_up_pieces(self.i, r0, r1)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(self.dtype)

    def down_rows(self, key, h, r0, r1):
        return self._mm(key, h, "down", r0, r1).to(self.dtype)


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


def run_projections(kernel: Kernel, key: int, x: torch.Tensor, hidden) -> torch.Tensor:
    """``down(hidden(gate_up(x)))`` of expert ``key`` for ``x [n, H]``: ``hidden`` maps ``[n, 2I] ->
    [n, I]`` (the activation and gate/up biases the device path applies; the plain SwiGLU,
    :func:`_silu_glu`, runs a fused kernel's :meth:`Kernel.swiglu`)."""
    if kernel.fused and hidden is _silu_glu:
        return kernel.swiglu(key, x)
    return kernel.down(key, hidden(kernel.gate_up(key, x)))


def _silu_glu(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    chosen = []
    for j in range(len(points)):
        best = min(kernels, key=lambda k: (seconds[k.name][j], not k.exact))
        chosen.append(best)
    return KernelChoice(tuple(points), chosen, seconds, store.expert_nbytes)
