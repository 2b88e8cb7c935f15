"""CPU kernels for one expert read straight from its host-store row: the torch ones and their base.

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
* ``int8-gemv``, ``bf16-gemv``, ``fp8-gemv`` (:mod:`moe_runtime.hybrid.gemv`), ``mxfp4-gemv``
  (:mod:`moe_runtime.hybrid.mxfp4_gemv`): compiled loops on the stored int8, bf16, fp8 or MXFP4
  rows, each weight widened to fp32 exactly, fp32 accumulators.
* ``int8pack``: int8 experts through ``torch.ops.aten._weight_int8pack_mm`` (activations in bf16
  unless the compute dtype is bf16 or fp16).

:mod:`moe_runtime.hybrid.kernel_choice` measures the eligible kernels at load on the store's own
experts and keeps the fastest per row count.

Each kernel also computes a range of a projection's output rows (``gate_up_rows``, ``down_rows``):
the executor splits one expert over every pool thread that way, as llama.cpp and KTransformers
split a matrix product's rows over their threads. A range is the same product on fewer weight
rows, so each output element's dot product is the whole product's where the range starts at a
multiple of :data:`ROW_ALIGN` (the executor checks this per kernel at load and runs a kernel whose
ranges differ whole). fp8's block scales span rows: its ``dequant`` runs whole (``fp8-gemv``
scales by absolute row blocks, so its ranges split).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: a range of output rows starts at a multiple of this: on this host's MKL sgemm and oneDNN a
#: product split at 16-row boundaries gives the whole product's bits for 1-32 token rows, where
#: 8-row boundaries did not (fp32, 4+ rows); 16 fp32 values are one AVX-512 register
ROW_ALIGN = 16


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
