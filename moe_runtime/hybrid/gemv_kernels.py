"""The ``int8-gemv``, ``bf16-gemv`` and ``fp8-gemv`` CPU expert kernels: the compiled loops of
:mod:`moe_runtime.hybrid.gemv` on every expert's stored weights, read in place from the host store.

A kernel runs on the calling thread, or with ``threads > 1`` over that many of numba's threads
(:mod:`moe_runtime.hybrid.gemv_parallel`: one call per projection, no Python per range), which
the executor uses instead of splitting an expert into ranges over its pool.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moe_runtime.hybrid.cpu_kernels import Kernel, gate_up_pieces
from moe_runtime.hybrid.gemv import gemv_rows, gemv_swiglu
from moe_runtime.hybrid.gemv_parallel import gemv_rows_parallel, gemv_swiglu_parallel, numba_threads


class Gemv(Kernel):
    """The compiled row-stream loops of :mod:`moe_runtime.hybrid.gemv` on the stored weights,
    fp32 accumulators; subclasses give every expert's ``[keys, N, K]`` weights per part
    (:meth:`_weights`), their scales (None: unscaled) and the scales' block (:attr:`block`,
    ``(1, 0)``: one per row)."""

    block = (1, 0)

    exact = False
    fused = True
    parallel = True

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        # numpy views of every expert's components, made once: a call only indexes them by key
        self._q, self._s = self._weights(store)
        # one call per whole expert in fp32 and bf16 (rounding the hidden activation as a bf16
        # device path does); fp16 runs by pieces
        self.fused = self.dtype in (torch.float32, torch.bfloat16)

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

    def _run(self, key: int, x: torch.Tensor, pieces, width: int, threads: int = 1) -> torch.Tensor:
        """``pieces``: ``(part, first, end)`` weight rows, their outputs side by side (``width``);
        ``threads > 1``: each over that many of numba's threads."""
        rows = gemv_rows if threads <= 1 else gemv_rows_parallel
        if threads > 1:
            numba_threads(threads)

        def fill(xs, out):
            col = 0
            for part, a, b in pieces:
                s = self._s[part]
                s = None if s is None else s[key]
                rows(self._q[part][key][a:b], s, *self.block, a, xs, out, col)
                col += b - a

        return self._call(x, width, fill)

    def gate_up(self, key, x, threads: int = 1):
        return self._run(key, x, (("gate", 0, self.i), ("up", 0, self.i)), 2 * self.i, threads)

    def down(self, key, h, threads: int = 1):
        return self._run(key, h, (("down", 0, self.h),), self.h, threads)

    def gate_up_rows(self, key, x, r0, r1):
        return self._run(key, x, gate_up_pieces(self.i, r0, r1), r1 - r0)

    def down_rows(self, key, h, r0, r1):
        return self._run(key, h, (("down", r0, r1),), r1 - r0)

    def swiglu(self, key, x, threads: int = 1):
        parts = [self._q[p][key] for p in ("gate", "up", "down")]
        scales = [None if self._s[p] is None else self._s[p][key] for p in ("gate", "up", "down")]
        bf16 = self.dtype == torch.bfloat16
        run = gemv_swiglu if threads <= 1 else gemv_swiglu_parallel
        if threads > 1:
            numba_threads(threads)
        return self._call(x, self.h, lambda xs, out: run(*parts, *scales, *self.block, xs, out, bf16))


class Int8Gemv(Gemv):
    """int8 experts, one scale per output row: 1 byte read per weight. An unsplit expert with the
    plain SwiGLU runs whole in one call (``swiglu``), as every gemv kernel's does."""

    name = "int8-gemv"

    def _weights(self, store):
        lay, data = self.layout, store.data
        q = {p: lay.view(data, p, "weight").numpy() for p in ("gate", "up", "down")}
        return q, {p: lay.view(data, p, "weight_scale").numpy() for p in ("gate", "up", "down")}


class Bf16Gemv(Gemv):
    """bf16 experts (a bf16 model's plain rows, or ``--expert-dtype bf16``): 2 bytes read per
    weight, each widened to fp32 exactly; the output is rounded once, to the compute dtype.
    oneDNN's bf16 ``F.linear`` at one token read a third of this host's roof."""

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


class Fp8Gemv(Gemv):
    """fp8 e4m3 experts with block scales (DeepSeek-V3's, Qwen3-FP8's): 1 byte read per weight,
    each widened exactly; a row block's scales multiply the token rows once, not each weight."""

    name = "fp8-gemv"

    def __init__(self, store: Any) -> None:
        self.block = store.layout.codec.block
        super().__init__(store)

    def _weights(self, store):
        lay, data = self.layout, store.data
        q = {p: lay.view(data, p, "weight").view(torch.uint8).numpy() for p in ("gate", "up", "down")}
        return q, {p: lay.view(data, p, "weight_scale_inv").numpy() for p in ("gate", "up", "down")}
