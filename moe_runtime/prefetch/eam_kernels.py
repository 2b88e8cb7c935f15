"""Compiled (numba) kernels of the ``eam`` plan's rows (MoE-Infinity §5.1,
:mod:`moe_runtime.prefetch.eam`): the EAMC matches' top-k counts (:func:`match_counts`), the
matched entries and the batch's own EAM summed and row-normalised into per-expert probabilities
(:func:`matched_row_probs`, :func:`own_plus_eamc`, :func:`row_probs`), each later layer's
candidate limit and layer-proximity weights (:func:`limit_scores`), and the router lookahead's
blend (:func:`blend`; our addition, not the paper's).

NOTE: why compiled. A plan at the Qwen3-30B-A3B shape (48 layers, 128 experts, top-8) ranks,
gates and selects up to a few hundred candidates; written as numpy it was dozens of calls of about
a microsecond each per planning layer (the plan cost three to six times the 50 us of host work
per MoE layer ``bench overhead`` budgets). Each kernel is one call. The kernels here and in
:mod:`~moe_runtime.prefetch.gate_kernels`, :mod:`~moe_runtime.prefetch.victim_kernels` and
:mod:`~moe_runtime.prefetch.term_kernels` compute exactly what the numpy code they replaced
computed (same float operations in the same order, stable sorts with the same tie rules; only
the runtime's host-time check sums in another order), so plans, and the simulator's outputs, are
bit-identical (``tools/sim_fingerprint.py``). They are the only implementation: the runtime and
the simulator both call them through the ``eam`` policy.

Each kernel is plain numpy-and-loops Python that numba compiles (``moe_runtime.jit``): that
Python, the kernel's ``py_func``, is its reference (``tests/test_prefetch_kernels.py`` checks the
compiled kernel against it and against the numpy each docstring names) and what runs where numba
is missing. ``cache=True`` keeps the machine code in ``__pycache__``, so only the first import on
a host compiles (a few seconds); :func:`warm` loads it when an ``eam`` policy is built.

NOTE: numba's cache keys a kernel on its own file only. A kernel of another file that calls one
of these (``gate_kernels.limit_gate_plan``, ``term_kernels.term_candidates``) keeps the old one
compiled in after an edit here until its own file changes: after editing a kernel another file
calls, delete ``moe_runtime/prefetch/__pycache__/*.nbi`` and ``*.nbc``.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.jit import njit


@njit(cache=True)
def _block_sum(a: np.ndarray, lo: int, n: int) -> np.float32:
    """float32 sum of ``a[lo : lo + n]``, ``n <= 128``, in numpy's order (below 8 one running
    sum, else 8 running sums combined pairwise, then the remainder)."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res = np.float32(res + a[lo + i])
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    end = n - n % 8
    while i < end:
        j = lo + i
        r0, r1 = np.float32(r0 + a[j]), np.float32(r1 + a[j + 1])
        r2, r3 = np.float32(r2 + a[j + 2]), np.float32(r3 + a[j + 3])
        r4, r5 = np.float32(r4 + a[j + 4]), np.float32(r5 + a[j + 5])
        r6, r7 = np.float32(r6 + a[j + 6]), np.float32(r7 + a[j + 7])
        i += 8
    left = np.float32(np.float32(r0 + r1) + np.float32(r2 + r3))
    res = np.float32(left + np.float32(np.float32(r4 + r5) + np.float32(r6 + r7)))
    while i < n:
        res = np.float32(res + a[lo + i])
        i += 1
    return res


@njit(cache=True)
def _pairwise_sum(a: np.ndarray, n: int) -> np.float32:
    """float32 sum of ``a[:n]`` in numpy's pairwise order, so it equals ``a.sum(dtype=np.float32)``:
    blocks of up to 128 (:func:`_block_sum`), longer spans halved on a multiple of 8, left + right.
    Iterative (an explicit stack): numba's on-disk cache crashes on recursive functions."""
    if n <= 128:
        return _block_sum(a, 0, n)
    los = np.empty(64, dtype=np.int64)
    ns = np.empty(64, dtype=np.int64)
    step = np.zeros(64, dtype=np.int64)  # 0: left next, 1: right next, 2: combine
    vals = np.empty(64, dtype=np.float32)
    sp, vp = 0, 0
    los[0], ns[0] = 0, n
    while sp >= 0:
        lo, m = los[sp], ns[sp]
        if m <= 128:
            vals[vp] = _block_sum(a, lo, m)
            vp += 1
            sp -= 1
            continue
        half = m // 2
        half -= half % 8
        if step[sp] == 2:
            vals[vp - 2] = np.float32(vals[vp - 2] + vals[vp - 1])
            vp -= 1
            sp -= 1
            continue
        child_lo, child_n = (lo, half) if step[sp] == 0 else (lo + half, m - half)
        step[sp] += 1
        sp += 1
        los[sp], ns[sp], step[sp] = child_lo, child_n, 0
    return vals[0]


@njit(cache=True)
def row_probs(x: np.ndarray) -> np.ndarray:
    """Each row of ``x [D, E]`` (float32, non-negative) divided by its sum, as
    ``x / x.sum(axis=1, keepdims=True, dtype=np.float32)`` computes it; zero rows stay zero."""
    D, E = x.shape
    out = np.empty_like(x)
    for d in range(D):
        total = _pairwise_sum(x[d], E)
        if total == 0:
            total = np.float32(1.0)
        for e in range(E):
            out[d, e] = x[d, e] / total
    return out


@njit(cache=True)
def matched_row_probs(entries: np.ndarray, times: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, bool]:
    """:func:`row_probs` of ``sum_i times[i] * entries[i, lo:hi]`` over the entries matched at
    least once (``times [n]`` int64 > 0), read in place from ``entries [n, L, E]`` (float32):
    each product rounded to float32 and added in ascending ``i``, as
    ``np.einsum("m,mf->f", times[m].astype(np.float32), entries[m, lo:hi])`` with
    ``m = times.nonzero()[0]`` computes it. Returns ``(rows [hi - lo, E] float32, whether any
    entry matched)``."""
    n, _, E = entries.shape
    summed = np.zeros((hi - lo, E), dtype=np.float32)
    matched = False
    for i in range(n):
        if times[i] == 0:
            continue
        matched = True
        t = np.float32(times[i])
        for d in range(hi - lo):
            for e in range(E):
                summed[d, e] = np.float32(summed[d, e] + np.float32(t * entries[i, lo + d, e]))
    return row_probs(summed), matched


@njit(cache=True)
def own_plus_eamc(own: np.ndarray, eamc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``eam`` prediction of rows ``[D, E]`` (float32): ``total = own + eamc`` (``eamc``
    with no rows: ``own`` alone), returned as ``(row_probs(total), [D] bool rows of total with
    any non-zero entry)``, as ``total.any(axis=1)``."""
    D, E = own.shape
    total = own.copy()
    if eamc.shape[0]:
        for d in range(D):
            for e in range(E):
                total[d, e] = np.float32(own[d, e] + eamc[d, e])
    evidence = np.zeros(D, dtype=np.bool_)
    for d in range(D):
        for e in range(E):
            if total[d, e] != 0:
                evidence[d] = True
                break
    return row_probs(total), evidence


@njit(cache=True)
def limit_scores(
    probs: np.ndarray, cap: int, min_prob: float, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``probs [D, E]`` (float32) with entries below ``min_prob`` and outside its
    ``cap`` largest (ties with the ``cap``-th kept) zeroed, and those rows times ``weights [D]``
    (float64, rounded back to float32). Returns ``(rows [D, E], scores [D, E])``, both float32."""
    D, E = probs.shape
    rows = np.empty_like(probs)
    scores = np.empty_like(probs)
    for d in range(D):
        row = probs[d].copy()
        if min_prob > 0:
            for e in range(E):
                if not row[e] >= min_prob:
                    row[e] = 0.0
        if 0 < cap < E:
            kth = np.partition(-row, cap - 1)[cap - 1]  # minus the cap-th largest
            for e in range(E):
                if not row[e] >= -kth:
                    row[e] = 0.0
        w = weights[d]
        for e in range(E):
            rows[d, e] = row[e]
            scores[d, e] = np.float32(np.float64(row[e]) * w)
    return rows, scores


@njit(cache=True)
def blend(rows: np.ndarray, ahead: np.ndarray, weight: float) -> np.ndarray:
    """``rows [n, E]`` (float32) with the router lookahead ``ahead [d, E]`` (``d <= n``) blended
    into its first ``d`` rows: ``row_probs(rows[:d] + row_probs(ahead) * weight)``; a new array."""
    out = rows.copy()
    d = ahead.shape[0]
    spec = row_probs(ahead)
    w = np.float32(weight)
    mixed = np.empty_like(spec)
    for i in range(d):
        for e in range(spec.shape[1]):
            mixed[i, e] = np.float32(out[i, e] + np.float32(spec[i, e] * w))
    out[:d] = row_probs(mixed)
    return out


@njit(cache=True)
def _heap_less(v1: float, v2: float, i1: int, i2: int) -> bool:
    """faiss ``CMin::cmp2``: ``(v1, i1)`` before ``(v2, i2)`` in a min-heap (ties: lower id)."""
    return v1 < v2 or (v1 == v2 and i1 < i2)


@njit(cache=True)
def _heap_replace_top(k: int, vals: np.ndarray, ids: np.ndarray, val: float, idx: int) -> None:
    """faiss ``heap_replace_top`` of a ``CMin`` heap ``vals, ids [k]`` (1-based as there)."""
    i = 1
    while True:
        i1 = i << 1
        i2 = i1 + 1
        if i1 > k:
            break
        c = i1 if i2 == k + 1 or _heap_less(vals[i1 - 1], vals[i2 - 1], ids[i1 - 1], ids[i2 - 1]) else i2
        if _heap_less(val, vals[c - 1], idx, ids[c - 1]):
            break
        vals[i - 1] = vals[c - 1]
        ids[i - 1] = ids[c - 1]
        i = c
    vals[i - 1] = val
    ids[i - 1] = idx


@njit(cache=True)
def match_counts(scores: np.ndarray, k: int) -> np.ndarray:
    """``[n]`` int64: how many of the ``B`` queries have each entry among their ``min(k, n)``
    best by ``scores [B, n]`` (float32, finite), the top ``k`` that faiss's
    ``float_minheap_array_t`` (``addn``, which ``tracer.prefix_match.PrefixMatcher`` uses)
    selects: the same heap, so equal scores resolve as there (``_heap_less``), and
    ``np.bincount`` of that top-k's ids equals the result."""
    B, n = scores.shape
    k = min(k, n)
    times = np.zeros(n, dtype=np.int64)
    vals = np.empty(k, dtype=np.float32)
    ids = np.empty(k, dtype=np.int64)
    for b in range(B):
        vals[:] = -np.inf
        ids[:] = -1
        for j in range(n):
            if vals[0] < scores[b, j]:
                _heap_replace_top(k, vals, ids, scores[b, j], j)
        for i in range(k):
            if ids[i] >= 0:
                times[ids[i]] += 1
    return times


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) these kernels for the types the ``eam`` policy passes,
    once per process: the first call of a kernel otherwise costs up to a second, which would
    land on a planning layer's clock."""
    global _warm
    if _warm:
        return
    rows = np.zeros((1, 2), dtype=np.float32)
    limit_scores(rows, 1, 0.0, np.ones(1))
    blend(rows, rows, 2.0)
    row_probs(rows)  # the policy's own term, once per step (eam._row_probs)
    match_counts(rows, 1)
    entries = np.zeros((1, 1, 2), dtype=np.float32)
    entries.flags.writeable = False  # EAMC.entries() is a read-only view
    matched_row_probs(entries, np.ones(1, dtype=np.int64), 0, 1)
    own_plus_eamc(rows, rows)
    own_plus_eamc(rows, rows[:0])
    _warm = True
