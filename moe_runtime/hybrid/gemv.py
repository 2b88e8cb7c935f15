"""The ``*-gemv`` kernels' compiled loops: int8 (one scale per output row) or bf16 weights against
fp32 token rows, with fp32 accumulators, ``nogil`` so the CPU pool's threads run them side by side.

At decode an expert meets a few tokens and its time is reading its weights. One row at a time is
one sequential stream through the matrix, which left the memory system idle on a 2-core EPYC host
(11-16 GB/s from memory on one core): :func:`gemv_rows` reads four rows a quarter of the matrix
apart at once (22-24 GB/s at the Qwen3-30B-A3B expert's int8 matrices), and from two tokens on
widens each weight to fp32 once for a pair of tokens, the widening then being what bounds the
loop. :func:`gemv_swiglu` runs a whole expert with the plain SwiGLU in one call.

A weight is widened to fp32 by :func:`widen`: an int8 value converts; a bf16 value, held as its
16 bits (``int16``: numpy has no bf16), is the upper half of an fp32 (a shift, which vectorizes).
"""

from __future__ import annotations

import numpy as np

from moe_runtime.jit import njit

try:
    from numba import types
    from numba.extending import overload
except ImportError:  # pragma: no cover - numba is a dependency (see tracer.jit)
    overload = None

#: independent row streams :func:`gemv_rows` reads at once, a quarter of the matrix apart
STREAMS = 4


def widen(v):
    """One stored weight as fp32: an int8 (or fp32) value converted; a bf16 held as ``int16`` or
    ``uint16`` bits shifted into the upper half of an fp32's bits (exact)."""
    if isinstance(v, (np.int16, np.uint16)):
        bits = np.array([v]).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)[0]
    return np.float32(v)


if overload is not None:

    @overload(widen, inline="always", fastmath=True)
    def _widen_compiled(v):
        if v in (types.int16, types.uint16):
            return lambda v: np.uint32(np.uint32(v) << 16).view(np.float32)
        return lambda v: np.float32(v)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _scaled(a, scale, n: int):
    """Row ``n``'s sum times its scale (``scale`` None: unscaled, pruned at compile time)."""
    return a if scale is None else a * scale[n, 0]


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows(q, scale, x, out, col0: int, n0: int, n1: int, n2: int, n3: int, m: int) -> None:
    """Rows ``n0..n3`` of :func:`gemv_rows` against token ``m``, each row in its own accumulator
    (the same loop for every row, so a row's sum does not depend on which of the four it is)."""
    r0, r1, r2, r3 = q[n0], q[n1], q[n2], q[n3]
    xm = x[m]
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for k in range(q.shape[1]):
        xv = xm[k]
        a0 += widen(r0[k]) * xv
        a1 += widen(r1[k]) * xv
        a2 += widen(r2[k]) * xv
        a3 += widen(r3[k]) * xv
    out[m, col0 + n0] = _scaled(a0, scale, n0)
    out[m, col0 + n1] = _scaled(a1, scale, n1)
    out[m, col0 + n2] = _scaled(a2, scale, n2)
    out[m, col0 + n3] = _scaled(a3, scale, n3)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows_two_tokens(q, scale, x, out, col0: int, n0: int, n1: int, n2: int, n3: int, m: int) -> None:
    """:func:`_four_rows` for tokens ``m`` and ``m + 1`` at once: each weight is widened to fp32
    once for both (at 2+ tokens the widening, not memory, bounds the loop)."""
    r0, r1, r2, r3 = q[n0], q[n1], q[n2], q[n3]
    xa, xb = x[m], x[m + 1]
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
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
        out[mm, col0 + n0] = _scaled(c0, scale, n0)
        out[mm, col0 + n1] = _scaled(c1, scale, n1)
        out[mm, col0 + n2] = _scaled(c2, scale, n2)
        out[mm, col0 + n3] = _scaled(c3, scale, n3)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _row_group(q, scale, x, out, col0: int, n0: int, n1: int, n2: int, n3: int) -> None:
    """Rows ``n0..n3`` against every token: tokens in pairs, an odd last one alone."""
    m = 0
    while m + 2 <= x.shape[0]:
        _four_rows_two_tokens(q, scale, x, out, col0, n0, n1, n2, n3, m)
        m += 2
    if m < x.shape[0]:
        _four_rows(q, scale, x, out, col0, n0, n1, n2, n3, m)


@njit(nogil=True, fastmath=True, cache=True)
def gemv_rows(q: np.ndarray, scale: np.ndarray | None, x: np.ndarray, out: np.ndarray, col0: int) -> None:
    """``out[m, col0 + n] = scale[n] * sum_k widen(q[n, k]) * x[m, k]``: ``q [N, K]`` int8 or bf16
    bits (``int16``), ``scale [N, 1]`` float32 or None (no scale), ``x [M, K]`` float32
    C-contiguous, ``out [M, >= col0 + N]`` float32, fp32 accumulators.

    The rows are read as :data:`STREAMS` sequential streams a quarter of the matrix apart (row
    ``n`` beside rows ``n + N/4``, ``n + N/2``, ``n + 3N/4``), so the memory system has four
    streams in flight instead of one. The ``N mod 4`` last rows run through the same loop beside
    three rows before them (recomputed, the same bits), so with ``N >= 4`` a row's bits do not
    depend on where a range of rows starts or ends (identical rows would let the compiler merge
    the four sums into another loop: ``N < 4`` is exact to rounding only). On a 2-core EPYC host,
    from memory at one token and one thread: 22-24 GB/s at the Qwen3-30B-A3B expert's int8
    matrices (2048 and 768 long rows) against 11-16 GB/s for one row at a time. Tokens go in pairs
    (each weight widened once for two): 1.4x faster at 2-8 tokens than one by one."""
    n_out = q.shape[0]
    step = n_out // STREAMS
    for n in range(step):
        _row_group(q, scale, x, out, col0, n, n + step, n + 2 * step, n + 3 * step)
    for n in range(STREAMS * step, n_out):  # the tail: the same loop beside three earlier rows
        if n_out >= STREAMS:
            _row_group(q, scale, x, out, col0, n, n - 1, n - 2, n - 3)
        else:
            _row_group(q, scale, x, out, col0, n, n, n, n)


@njit(nogil=True, fastmath=True, cache=True)
def gemv_swiglu(qg, sg, qu, su, qd, sd, x: np.ndarray, out: np.ndarray) -> None:
    """One whole expert with the plain SwiGLU: ``out [M, H] = down(silu(gate(x)) * up(x))`` for
    ``x [M, H]`` float32, each projection by :func:`gemv_rows` (``q*`` int8 or bf16 bits
    ``[N, K]``, ``s*`` float32 ``[N, 1]`` or None). One call instead of three kernels and the
    activation's torch ops between them: at one token the Qwen3-30B-A3B int8 expert reads in about
    200 us, which the Python between the pieces (20-50 us) would stretch by a fifth."""
    inter = qg.shape[0]
    gu = np.empty((x.shape[0], 2 * inter), dtype=np.float32)
    gemv_rows(qg, sg, x, gu, 0)
    gemv_rows(qu, su, x, gu, inter)
    h = np.empty((x.shape[0], inter), dtype=np.float32)
    for m in range(x.shape[0]):
        for j in range(inter):
            g = gu[m, j]
            h[m, j] = g / (np.float32(1.0) + np.exp(-g)) * gu[m, inter + j]
    gemv_rows(qd, sd, h, out, 0)
