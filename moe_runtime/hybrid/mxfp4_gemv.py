"""The ``mxfp4-gemv`` CPU expert kernel: MXFP4 weights (gpt-oss's experts) against fp32 token
rows, read straight from the packed bytes, with fp32 accumulators, ``nogil`` so the CPU pool's
threads run it side by side.

An MXFP4 row is ``G`` groups of 32 e2m1 codes, two per byte (the low nibble the even element),
and one e8m0 scale byte per group (:mod:`moe_runtime.quant.mxfp4`). A code's sign, exponent and
mantissa bits move into an fp32's fields (``0.5``, e2m1's one subnormal, becomes an fp32
subnormal: the kernel needs a thread that does not flush them, which :func:`mxfp4_exact` checks);
that value is the code times ``2^-126``. The bias difference is applied half to the token rows
(times ``2^63``, split into their even and odd elements once per call, so a byte's two codes meet
two contiguous vectors) and half to the group's factor ``2^(scale - 127 + 63)``, so neither
overflows for activations under ``2^64`` and scales up to ``2^64``. Rows are read as four streams
a quarter of the matrix apart, as :func:`moe_runtime.hybrid.gemv.gemv_rows` reads them.
Dequantizing per call instead (``dequant``) built each expert's fp32 weights, 8x the bytes the
kernel reads.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.hybrid.gemv import Gemv
from moe_runtime.jit import njit
from moe_runtime.quant.mxfp4 import FP4_VALUES, GROUP

_HALF = GROUP // 2  # bytes per group


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _e2m1(c):
    """An e2m1 code's bits in an fp32's fields: the value times ``2^-126``."""
    c = np.uint32(c)
    return np.uint32(((c & np.uint32(8)) << 28) | ((c & np.uint32(7)) << 22)).view(np.float32)


_TWO_63 = np.float32(2.0**63)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _factor(s) -> np.float32:
    """``2^(s - 64)`` for a scale byte ``s`` from its float bits: exact for ``s <= 191``, infinite
    above (a scale over ``2^64`` is no weight's)."""
    return np.uint32((min(np.uint32(s), np.uint32(192)) + np.uint32(63)) << 23).view(np.float32)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows(blocks, scales, xe, xo, acc, out, m: int, col0: int, n0, n1, n2, n3) -> None:
    """Rows ``n0..n3`` against token ``m``'s even (``xe``) and odd (``xo``) elements, each row in
    its own 16 accumulators ``acc[i]`` (the same loop for every row)."""
    acc[:] = 0.0
    b0, b1, b2, b3 = blocks[n0], blocks[n1], blocks[n2], blocks[n3]
    for g in range(blocks.shape[1]):
        s0, s1 = _factor(scales[n0, g]), _factor(scales[n1, g])
        s2, s3 = _factor(scales[n2, g]), _factor(scales[n3, g])
        base = g * _HALF
        for j in range(_HALF):
            u, v = xe[base + j], xo[base + j]
            c0, c1, c2, c3 = b0[g, j], b1[g, j], b2[g, j], b3[g, j]
            acc[0, j] += (_e2m1(c0 & np.uint8(15)) * u + _e2m1(c0 >> np.uint8(4)) * v) * s0
            acc[1, j] += (_e2m1(c1 & np.uint8(15)) * u + _e2m1(c1 >> np.uint8(4)) * v) * s1
            acc[2, j] += (_e2m1(c2 & np.uint8(15)) * u + _e2m1(c2 >> np.uint8(4)) * v) * s2
            acc[3, j] += (_e2m1(c3 & np.uint8(15)) * u + _e2m1(c3 >> np.uint8(4)) * v) * s3
    out[m, col0 + n0] = acc[0].sum()
    out[m, col0 + n1] = acc[1].sum()
    out[m, col0 + n2] = acc[2].sum()
    out[m, col0 + n3] = acc[3].sum()


@njit(nogil=True, fastmath=True, cache=True)
def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray, col0: int) -> None:
    """``out[m, col0 + n] = sum_k w[n, k] * x[m, k]`` for MXFP4 rows ``blocks [N, G, 16]`` uint8 and
    ``scales [N, G]`` uint8, ``x [M, K]`` float32 (``K <= 32 G``; the padded tail is zero),
    ``out [M, >= col0 + N]`` float32. Four streams a quarter of the rows apart; the ``N mod 4``
    last rows beside three rows before them (recomputed, the same bits), so with ``N >= 4`` a
    range of rows gives the whole product's bits."""
    n_out, groups = blocks.shape[0], blocks.shape[1]
    xe = np.zeros((x.shape[0], groups * _HALF), dtype=np.float32)
    xo = np.zeros((x.shape[0], groups * _HALF), dtype=np.float32)
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            if k % 2 == 0:
                xe[m, k // 2] = x[m, k] * _TWO_63
            else:
                xo[m, k // 2] = x[m, k] * _TWO_63
    acc = np.empty((4, _HALF), dtype=np.float32)
    step = n_out // 4
    for m in range(x.shape[0]):
        for i in range(step):
            _four_rows(
                blocks, scales, xe[m], xo[m], acc, out, m, col0, i, i + step, i + 2 * step, i + 3 * step
            )
        for n in range(4 * step, n_out):
            if n_out >= 4:
                _four_rows(blocks, scales, xe[m], xo[m], acc, out, m, col0, n, n - 1, n - 2, n - 3)
            else:
                _four_rows(blocks, scales, xe[m], xo[m], acc, out, m, col0, n, n, n, n)


def mxfp4_exact() -> bool:
    """Whether this thread computes every e2m1 code at scale 2^0 exactly (fp32 subnormals not
    flushed to zero)."""
    codes = np.arange(16, dtype=np.uint8)
    blocks = np.zeros((16, 1, _HALF), dtype=np.uint8)
    blocks[:, 0, 0] = codes  # element 0 of each row: the code; the rest 0
    out = np.zeros((1, 16), dtype=np.float32)
    mxfp4_rows(blocks, np.full((16, 1), 127, dtype=np.uint8), np.ones((1, GROUP), dtype=np.float32), out, 0)
    return bool(np.array_equal(out[0], np.array(FP4_VALUES, dtype=np.float32)))


class Mxfp4Gemv(Gemv):
    """MXFP4 experts through :func:`mxfp4_rows`: half a byte read per weight; by pieces (no
    whole-expert call)."""

    name = "mxfp4-gemv"
    fused = False

    def _weights(self, store):
        lay, data = self.layout, store.data
        blocks = {p: lay.view(data, p, "blocks").numpy() for p in ("gate", "up", "down")}
        return blocks, {p: lay.view(data, p, "scales").numpy() for p in ("gate", "up", "down")}

    def _rows(self, part, key, a, b, xs, out, col):
        mxfp4_rows(self._q[part][key][a:b], self._s[part][key][a:b], xs, out, col)
