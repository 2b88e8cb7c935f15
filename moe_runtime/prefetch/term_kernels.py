"""Compiled (numba) kernels of the weighed EAMC term (ours; :mod:`moe_runtime.prefetch.term_value`):
the next layer's candidates of a plan with the EAMC term and without it (:func:`term_candidates`)
and, once that layer routes, how many more of the first set it used (:func:`used_difference`).

Each kernel is plain numpy-and-loops Python that numba compiles (``moe_runtime.jit``); its
``py_func`` is the reference the tests check it against (``tests/test_term_value.py``). See
:mod:`moe_runtime.prefetch.eam_kernels` on numba's cache: the compiled kernels here keep the
``eam_kernels.blend`` and ``gate_kernels.used_mask`` they call until this file changes.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.jit import njit
from moe_runtime.prefetch.eam_kernels import blend
from moe_runtime.prefetch.gate_kernels import used_mask


@njit(cache=True)
def used_difference(ids: np.ndarray, with_term: np.ndarray, without_term: np.ndarray) -> int:
    """How many more of the experts ``with_term [n]`` than of ``without_term [m]`` (ids >= 0,
    int64) are among the routed ``ids [T * k]`` (int64; negative: none): ``TermValue.observe``'s
    difference in one compiled call (as numpy, a mask, two gathers and two sums, 15-19 us of a
    planning layer with the caches cold, batch 16)."""
    size = 1
    for i in range(ids.size):
        if ids[i] + 1 > size:
            size = ids[i] + 1
    used = used_mask(ids, size)
    diff = 0
    for e in with_term:
        if e < size and used[e]:
            diff += 1
    for e in without_term:
        if e < size and used[e]:
            diff -= 1
    return diff


@njit(cache=True)
def top_candidates(row: np.ndarray, held: np.ndarray, cap: int) -> np.ndarray:
    """``[n]`` int64, ascending: the experts among the ``cap`` largest positive entries of ``row
    [E]`` (ties: lower id first; held ones take their places too) that ``held [E]`` does not
    mark: the experts of a plan's row a prefetch would copy (``term_value``). A set: the term
    counts how many of them a layer uses, so no order is kept (the best-first order cost a sort,
    or a count per candidate, of about 4 us at 128 experts). A row with at most ``cap`` positive
    entries keeps all of them; else the ``cap``-th largest value bounds the set (a partition)."""
    E = row.size
    cap = min(max(cap, 0), E)
    positive = 0
    for e in range(E):
        positive += row[e] > 0
    out = np.empty(E, dtype=np.int64)
    m = 0
    if positive <= cap:
        for e in range(E):
            if row[e] > 0 and not held[e]:
                out[m] = e
                m += 1
        return out[:m]
    if cap == 0:
        return out[:0]
    kth = -np.partition(-row, cap - 1)[cap - 1]  # the cap-th largest (> 0: more are positive)
    ties = cap
    for e in range(E):
        ties -= row[e] > kth
    for e in range(E):  # the ties kth keeps: the lowest ids first
        v = row[e]
        if v < kth:
            continue
        if v == kth:
            if ties == 0:
                continue
            ties -= 1
        if not held[e]:
            out[m] = e
            m += 1
    return out[:m]


@njit(cache=True)
def term_candidates(
    with_rows: np.ndarray,
    without_rows: np.ndarray,
    ahead: np.ndarray,
    weight: float,
    held: np.ndarray,
    cap: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The next layer's candidates of a plan with the EAMC term and without it
    (``GatedPlanning._note_eamc_term``, ``moe_runtime.prefetch.term_value``) in one call:
    :func:`top_candidates` of row 0 of ``with_rows [D, E]`` and of ``without_rows [D', E]``
    (float32), each with the router lookahead ``ahead [d, E]`` blended in as :func:`blend`
    blends it (``d`` 0: none), against ``held [E]`` (the next layer's held mask) and ``cap``.
    Only row 0 is read: :func:`blend`'s row 0 depends on ``rows[0]`` and ``ahead[0]`` alone.
    Returns ``(with_ids [n], without_ids [m])``, int64."""
    if ahead.shape[0]:
        first = ahead[:1]
        return (
            top_candidates(blend(with_rows[:1], first, weight)[0], held, cap),
            top_candidates(blend(without_rows[:1], first, weight)[0], held, cap),
        )
    return top_candidates(with_rows[0], held, cap), top_candidates(without_rows[0], held, cap)


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) these kernels for the types the ``eam`` policy
    passes, once per process (off a planning layer's clock)."""
    global _warm
    if _warm:
        return
    rows = np.zeros((1, 2), dtype=np.float32)
    held = np.zeros(2, dtype=np.bool_)
    one_id = np.zeros(1, dtype=np.int64)
    used_difference(one_id, one_id, one_id)
    for ahead in (rows, rows[:0]):
        term_candidates(rows, rows, ahead, 1.0, held, 1)
    _warm = True
