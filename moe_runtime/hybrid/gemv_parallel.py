"""The gemv loops of :mod:`moe_runtime.hybrid.gemv` over several of numba's threads.

At decode one expert is a few matrix-vector products, and one core reads memory at a fraction of
a socket's rate, so every thread must work on each expert. The executor's pool splits an expert
into ranges of output rows, one Python call per range with a barrier between the gate/up and down
ranges (about 50 us a range on a 2-core host: an int8 Qwen3-30B-A3B expert took 0.42 ms over two
threads, 0.22 ms on one). Here one compiled call spreads a projection's row groups over numba's
threads (``prange``; ``numba.set_num_threads`` of the calling thread chooses how many), and each
row runs the serial kernel's loop, so the bits are the serial kernel's whatever the thread count.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.hybrid.gemv import STREAMS, _round_bf16, _row_group, _x_blocks
from moe_runtime.jit import njit

try:
    import numba
    from numba import prange
except ImportError:  # pragma: no cover - numba is a dependency (see tracer.jit)
    numba = None
    prange = range


def numba_threads(threads: int) -> int:
    """Set the calling thread's numba thread count to ``threads`` (at most numba's pool size);
    returns the count set (1 without numba)."""
    if numba is None:
        return 1
    n = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


@njit(nogil=True, fastmath=True, cache=True, parallel=True)
def gemv_rows_parallel(
    q, scale, br: int, bc: int, row0: int, x: np.ndarray, out: np.ndarray, col0: int
) -> None:
    """:func:`moe_runtime.hybrid.gemv.gemv_rows` (same arguments, same bits) with each row block's
    groups of four rows spread over numba's threads."""
    xb, first = _x_blocks(x, scale, br, bc, row0, q.shape[0])
    for j in range(xb.shape[0]):  # one block, or fp8's row blocks
        a = 0 if xb.shape[0] == 1 else max((first + j) * br - row0, 0)
        b = q.shape[0] if xb.shape[0] == 1 else min((first + j + 1) * br - row0, q.shape[0])
        xj = xb[j]
        n_out = b - a
        step = n_out // STREAMS
        for i in prange(step):
            n = a + i
            _row_group(q, xj, scale, bc, row0, out, col0, n, n + step, n + 2 * step, n + 3 * step)
        for n in range(a + STREAMS * step, b):  # the tail, as the serial loop runs it
            if n_out >= STREAMS:
                _row_group(q, xj, scale, bc, row0, out, col0, n, n - 1, n - 2, n - 3)
            else:
                _row_group(q, xj, scale, bc, row0, out, col0, n, n, n, n)


@njit(nogil=True, fastmath=True, cache=True)
def gemv_swiglu_parallel(
    qg, qu, qd, sg, su, sd, br: int, bc: int, x: np.ndarray, out: np.ndarray, bf16: bool
):
    """:func:`moe_runtime.hybrid.gemv.gemv_swiglu` (same arguments, same bits) with each
    projection over numba's threads."""
    inter = qg.shape[0]
    gu = np.empty((x.shape[0], 2 * inter), dtype=np.float32)
    gemv_rows_parallel(qg, sg, br, bc, 0, x, gu, 0)
    gemv_rows_parallel(qu, su, br, bc, 0, x, gu, inter)
    h = np.empty((x.shape[0], inter), dtype=np.float32)
    for m in range(x.shape[0]):
        for j in range(inter):
            g, u = gu[m, j], gu[m, inter + j]
            if bf16:
                g, u = _round_bf16(g), _round_bf16(u)
                h[m, j] = _round_bf16(_round_bf16(g / (np.float32(1.0) + np.exp(-g))) * u)
            else:
                h[m, j] = g / (np.float32(1.0) + np.exp(-g)) * u
    gemv_rows_parallel(qd, sd, br, bc, 0, h, out, 0)
