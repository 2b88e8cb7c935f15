"""The ``*-gemv`` CPU expert kernels and their compiled loops: int8, bf16 or fp8 weights against
fp32 token rows, with fp32 accumulators, ``nogil`` so the CPU pool's threads run them side by side.

At decode an expert meets a few tokens and its time is reading its weights. One row at a time is
one sequential stream through the matrix, which left the memory system idle on a 2-core EPYC host
(11-16 GB/s from memory on one core): :func:`gemv_rows` reads four rows a quarter of the matrix
apart at once (22-24 GB/s at the Qwen3-30B-A3B expert's int8 matrices), and from two tokens on
widens each weight to fp32 once for a pair of tokens, the widening then being what bounds the
loop. :func:`gemv_swiglu` runs a whole expert with the plain SwiGLU in one call.

A weight is widened to fp32 by :func:`widen`, by its numpy dtype (numpy has no bf16 or fp8):
``int8`` converts; ``int16`` holds bf16 bits, the upper half of an fp32 (a shift); ``uint8``
holds fp8 e4m3fn bits (DeepSeek-V3's and Qwen3-FP8's experts): sign, exponent and mantissa moved
into an fp32's fields and multiplied by 2^120 (the bias difference; e4m3's subnormals become fp32
subnormals, so this needs a thread that does not flush them: :func:`e4m3_exact` checks). Every
widening is exact and vectorizes.

Scales: int8's one per row (``scale [N, 1]``, ``br = 1, bc = 0``) multiplies the row's sum; fp8's
blocks (``scale [ceil(N / br), ceil(K / bc)]``, 128 x 128) multiply the token rows, once per
row block, before the loop; bf16 has none (``scale`` None).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moe_runtime.hybrid.cpu_kernels import Kernel, gate_up_pieces
from moe_runtime.jit import njit

try:
    from numba import types
    from numba.extending import overload
except ImportError:  # pragma: no cover - numba is a dependency (see tracer.jit)
    overload = None

#: independent row streams :func:`gemv_rows` reads at once, a quarter of the matrix apart
STREAMS = 4
_TWO_120 = np.float32(2.0**120)  # fp32's exponent bias less e4m3's (127 - 7)


def widen(v):
    """One stored weight as fp32 (see the module note): ``int8`` (or float) converted, ``int16`` /
    ``uint16`` bf16 bits, ``uint8`` fp8 e4m3fn bits (its NaN codes, absent from weights, widen to
    +-480)."""
    if isinstance(v, (np.int16, np.uint16)):
        bits = np.array([v]).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)[0]
    if isinstance(v, np.uint8):
        mag = int(v) & 0x7F
        val = float(mag) * 2.0**-9 if mag < 8 else 2.0 ** ((mag >> 3) - 7) * (1 + (mag & 7) / 8)
        return np.float32(-val if int(v) & 0x80 else val)
    return np.float32(v)


def e4m3_exact() -> bool:
    """Whether this thread widens every e4m3 code exactly (fp32 subnormals not flushed to zero)."""
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(-1, 1)  # not the NaN codes
    out = np.zeros((1, codes.shape[0]), dtype=np.float32)
    gemv_rows(codes, None, 1, 0, 0, np.ones((1, 1), dtype=np.float32), out, 0)
    return all(out[0, i] == widen(np.uint8(c)) for i, c in enumerate(codes[:, 0]))


if overload is not None:

    @overload(widen, inline="always", fastmath=True)
    def _widen_compiled(v):
        if v in (types.int16, types.uint16):
            return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)
        if v == types.uint8:

            def e4m3(v):  # the bits moved into an fp32's fields, rebiased by one product
                # the code sign-extended, shifted so its bit 7 is the sign (the copies between
                # masked off) and bits 6..0 are the exponent's low bits and the mantissa's top
                bits = (np.int32(np.int8(v)) << 20) & np.int32(-0x78100000)  # 0x87F00000
                return np.uint32(bits).view(np.float32) * _TWO_120

            return e4m3
        return lambda v: np.float32(v)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _row_scaled(a, scale, bc: int, row: int):
    """Row ``row``'s sum times its scale where the scales are per row (``bc <= 0``); block scales
    are already in the token rows (:func:`_x_blocks`); ``scale`` None is pruned at compile time."""
    return a if scale is None else (a if bc > 0 else a * scale[row, 0])


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _x_blocks(x, scale, br: int, bc: int, row0: int, n_rows: int):
    """``(xb [blocks, M, K], first block)``: for block scales, ``x`` times each row block's column
    scales (``xb[j, m, k] = x[m, k] * scale[first + j, k // bc]``), so a row's dot product with its
    block's rows is the scaled sum and its loop has no blocks; else ``x`` itself as one block."""
    if scale is None:
        return x.reshape((1, x.shape[0], x.shape[1])), 0
    if bc <= 0:
        return x.reshape((1, x.shape[0], x.shape[1])), 0
    first = row0 // br
    xb = np.empty(((row0 + n_rows - 1) // br - first + 1, x.shape[0], x.shape[1]), dtype=np.float32)
    for j in range(xb.shape[0]):
        for m in range(x.shape[0]):
            for kb in range(scale.shape[1]):
                s = scale[first + j, kb]
                for k in range(kb * bc, min(kb * bc + bc, x.shape[1])):
                    xb[j, m, k] = x[m, k] * s
    return xb, first


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows(q, x, scale, bc: int, row0: int, out, col0: int, n0, n1, n2, n3, m: int) -> None:
    """Rows ``n0..n3`` of :func:`gemv_rows` against token ``m``, each row in its own accumulator
    (the same loop for every row, so a row's sum does not depend on which of the four it is)."""
    r0, r1, r2, r3 = q[n0], q[n1], q[n2], q[n3]
    xm = x[m]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(q.shape[1]):
        xv = xm[k]
        a0 += widen(r0[k]) * xv
        a1 += widen(r1[k]) * xv
        a2 += widen(r2[k]) * xv
        a3 += widen(r3[k]) * xv
    out[m, col0 + n0] = _row_scaled(a0, scale, bc, row0 + n0)
    out[m, col0 + n1] = _row_scaled(a1, scale, bc, row0 + n1)
    out[m, col0 + n2] = _row_scaled(a2, scale, bc, row0 + n2)
    out[m, col0 + n3] = _row_scaled(a3, scale, bc, row0 + n3)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows_two_tokens(q, x, scale, bc: int, row0: int, out, col0: int, n0, n1, n2, n3, m: int):
    """:func:`_four_rows` for tokens ``m`` and ``m + 1`` at once: each weight is widened to fp32
    once for both (at 2+ tokens the widening, not memory, bounds the loop)."""
    r0, r1, r2, r3 = q[n0], q[n1], q[n2], q[n3]
    xa, xb = x[m], x[m + 1]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for k in range(q.shape[1]):
        w0, w1, w2, w3 = widen(r0[k]), widen(r1[k]), widen(r2[k]), widen(r3[k])
        u, v = xa[k], xb[k]
        a0 += w0 * u
        a1 += w1 * u
        a2 += w2 * u
        a3 += w3 * u
        b0 += w0 * v
        b1 += w1 * v
        b2 += w2 * v
        b3 += w3 * v
    for mm, c0, c1, c2, c3 in ((m, a0, a1, a2, a3), (m + 1, b0, b1, b2, b3)):
        out[mm, col0 + n0] = _row_scaled(c0, scale, bc, row0 + n0)
        out[mm, col0 + n1] = _row_scaled(c1, scale, bc, row0 + n1)
        out[mm, col0 + n2] = _row_scaled(c2, scale, bc, row0 + n2)
        out[mm, col0 + n3] = _row_scaled(c3, scale, bc, row0 + n3)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _row_group(q, x, scale, bc: int, row0: int, out, col0: int, n0, n1, n2, n3) -> None:
    """Rows ``n0..n3`` against every token: tokens in pairs, an odd last one alone."""
    m = 0
    while m + 2 <= x.shape[0]:
        _four_rows_two_tokens(q, x, scale, bc, row0, out, col0, n0, n1, n2, n3, m)
        m += 2
    if m < x.shape[0]:
        _four_rows(q, x, scale, bc, row0, out, col0, n0, n1, n2, n3, m)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _streams(q, a: int, b: int, x, scale, bc: int, row0: int, out, col0: int) -> None:
    """Rows ``a .. b - 1`` against ``x``: four streams a quarter of the rows apart, the
    ``(b - a) mod 4`` last rows beside three rows before them (see :func:`gemv_rows`)."""
    n_out = b - a
    step = n_out // STREAMS
    for n in range(a, a + step):
        _row_group(q, x, scale, bc, row0, out, col0, n, n + step, n + 2 * step, n + 3 * step)
    for n in range(a + STREAMS * step, b):  # the tail: the same loop beside three earlier rows
        if n_out >= STREAMS:
            _row_group(q, x, scale, bc, row0, out, col0, n, n - 1, n - 2, n - 3)
        else:
            _row_group(q, x, scale, bc, row0, out, col0, n, n, n, n)


@njit(nogil=True, fastmath=True, cache=True)
def gemv_rows(q, scale, br: int, bc: int, row0: int, x: np.ndarray, out: np.ndarray, col0: int) -> None:
    """``out[m, col0 + n] = sum_k widen(q[n, k]) * scale[(row0 + n) // br, k // bc] * x[m, k]``:
    ``q [N, K]`` stored weights (int8; bf16 bits as ``int16``; fp8 e4m3fn bits as ``uint8``), rows
    ``row0 ..`` of a matrix whose ``scale`` (float32, blocks of ``br x bc``; ``bc = 0``: one per
    row, applied to the row's sum; or None) covers every row; ``x [M, K]`` float32 C-contiguous,
    ``out [M, >= col0 + N]`` float32, fp32 accumulators. Block scales multiply the token rows once
    per row block (:func:`_x_blocks`), so every format runs the same unblocked loop.

    The rows are read as :data:`STREAMS` sequential streams a quarter of the matrix apart (row
    ``n`` beside rows ``n + N/4``, ``n + N/2``, ``n + 3N/4``), so the memory system has four
    streams in flight instead of one. The ``N mod 4`` last rows run through the same loop beside
    three rows before them (recomputed, the same bits), so with ``N >= 4`` a row's bits do not
    depend on where a range of rows starts or ends (identical rows would let the compiler merge
    the four sums into another loop: ``N < 4`` is exact to rounding only). On a 2-core EPYC host,
    from memory at one token and one thread: 22-24 GB/s at the Qwen3-30B-A3B expert's int8
    matrices (2048 and 768 long rows) against 11-16 GB/s for one row at a time. Tokens go in pairs
    (each weight widened once for two): 1.4x faster at 2-8 tokens than one by one."""
    xb, first = _x_blocks(x, scale, br, bc, row0, q.shape[0])
    for j in range(xb.shape[0]):  # block scales: each row block's rows against its own token rows
        a = 0 if xb.shape[0] == 1 else max((first + j) * br - row0, 0)
        b = q.shape[0] if xb.shape[0] == 1 else min((first + j + 1) * br - row0, q.shape[0])
        _streams(q, a, b, xb[j], scale, bc, row0, out, col0)


@njit(nogil=True, fastmath=True, cache=True)
def gemv_swiglu(qg, qu, qd, sg, su, sd, br: int, bc: int, x: np.ndarray, out: np.ndarray, bf16: bool) -> None:
    """One whole expert with the plain SwiGLU: ``out [M, H] = down(silu(gate(x)) * up(x))`` for
    ``x [M, H]`` float32, each projection by :func:`gemv_rows` (``q*`` stored weights ``[N, K]``,
    ``s*`` their scales by ``br x bc`` blocks, or None). One call instead of three kernels and the
    activation's torch ops between them: at one token the Qwen3-30B-A3B int8 expert reads in about
    200 us, which the Python between the pieces (20-50 us) would stretch by a fifth. ``bf16``: the
    gate and up outputs, the SiLU and the product are each rounded to bf16, as a bf16 model's
    device path rounds them (its output is rounded by the caller)."""
    inter = qg.shape[0]
    gu = np.empty((x.shape[0], 2 * inter), dtype=np.float32)
    gemv_rows(qg, sg, br, bc, 0, x, gu, 0)
    gemv_rows(qu, su, br, bc, 0, x, gu, inter)
    h = np.empty((x.shape[0], inter), dtype=np.float32)
    for m in range(x.shape[0]):
        for j in range(inter):
            g, u = gu[m, j], gu[m, inter + j]
            if bf16:
                g, u = _round_bf16(g), _round_bf16(u)
                h[m, j] = _round_bf16(_round_bf16(g / (np.float32(1.0) + np.exp(-g))) * u)
            else:
                h[m, j] = g / (np.float32(1.0) + np.exp(-g)) * u
    gemv_rows(qd, sd, br, bc, 0, h, out, 0)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _round_bf16(v):
    """``v`` rounded to the nearest bf16 (ties to even), as an fp32; finite ``v`` only."""
    bits = np.uint32(np.float32(v).view(np.uint32))
    bits = np.uint32(
        np.uint32(bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    )
    return bits.view(np.float32)


class Gemv(Kernel):
    """The compiled row-stream loops of :mod:`moe_runtime.hybrid.gemv` on the stored weights,
    fp32 accumulators; subclasses give every expert's ``[keys, N, K]`` weights per part
    (:meth:`_weights`), their scales (None: unscaled) and the scales' block (:attr:`block`,
    ``(1, 0)``: one per row), or another loop for a range of rows (:meth:`_rows`)."""

    block = (1, 0)

    exact = False
    fused = True

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        # numpy views of every expert's components, made once: a call only indexes them by key
        self._q, self._s = self._weights(store)
        # one call per whole expert in fp32 and bf16 (rounding the hidden activation as a bf16
        # device path does); fp16 runs by pieces
        self.fused = self.fused and self.dtype in (torch.float32, torch.bfloat16)

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
                self._rows(part, key, a, b, xs, out, col)
                col += b - a

        return self._call(x, width, fill)

    def _rows(self, part: str, key: int, a: int, b: int, xs: np.ndarray, out: np.ndarray, col: int) -> None:
        """Rows ``a:b`` of expert ``key``'s ``part`` against ``xs`` into ``out[:, col:]``."""
        s = self._s[part]
        gemv_rows(self._q[part][key][a:b], None if s is None else s[key], *self.block, a, xs, out, col)

    def gate_up(self, key, x):
        return self._run(key, x, (("gate", 0, self.i), ("up", 0, self.i)), 2 * self.i)

    def down(self, key, h):
        return self._run(key, h, (("down", 0, self.h),), self.h)

    def gate_up_rows(self, key, x, r0, r1):
        return self._run(key, x, gate_up_pieces(self.i, r0, r1), r1 - r0)

    def down_rows(self, key, h, r0, r1):
        return self._run(key, h, (("down", r0, r1),), r1 - r0)

    def swiglu(self, key, x):
        parts = [self._q[p][key] for p in ("gate", "up", "down")]
        scales = [None if self._s[p] is None else self._s[p][key] for p in ("gate", "up", "down")]
        bf16 = self.dtype == torch.bfloat16
        return self._call(x, self.h, lambda xs, out: gemv_swiglu(*parts, *scales, *self.block, xs, out, bf16))


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
