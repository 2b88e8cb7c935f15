"""Compiled (numba) kernels of the cost gate's victims (ours; :mod:`moe_runtime.prefetch.gate`):
which held experts a plan's prefetches would evict, and how likely the next step uses them.

The gate's cost of a prefetch holds ``R * b``: the chance ``R`` that the expert it evicts is
used again in the next step, times the blocking per miss. The ``i``-th prefetch in plan order
evicts the ``i``-th least used held expert outside the running layer once the slots are full, so
a plan needs the smallest next-step use of the held experts (:func:`least_used`), as many as the
candidates that pay without an eviction. ``gate_kernels.gate_plan`` calls it inside the plan's
one compiled call.

Each kernel is plain numpy-and-loops Python that numba compiles (``moe_runtime.jit``); its
``py_func`` is the reference ``tests/test_prefetch_kernels.py`` checks it against (see
:mod:`moe_runtime.prefetch.eam_kernels` on why the plan is compiled and on numba's cache, which
does not notice an edit here in the compiled ``gate_plan`` of another file).
"""

from __future__ import annotations

import numpy as np

from moe_runtime.jit import njit

# least_used: a heap pass costs about this many key-compares' time more than a walk of the sorted
# use per value kept (batch 16 at the Qwen3-30B-A3B shape, 6144 keys: heap 17-20 us, walk 5, for
# about 85 kept; batch 4, 19 kept: 8.5 against 4.9; batch 1: the same), and a sort of ``n`` keys
# about ``n log2 n`` of them (6144 keys: 80 us)
HEAP_COST_PER_KEPT = 165


@njit(cache=True)
def least_used_sort_work(n: int) -> float:
    """A sort of ``n`` keys' cost in :func:`least_used`'s heap work (values kept by heap passes)."""
    return n * np.log2(max(n, 2)) / HEAP_COST_PER_KEPT


@njit(cache=True)
def count_true(mask: np.ndarray) -> int:
    """How many entries of ``mask [n]`` (bool, C-contiguous) are True: eight at a time, the bytes
    (each 0 or 1) of a 64-bit word summed into its low byte by three shifted adds (no carry
    crosses a byte: a sum is at most 8), then the tail (0.25 us for 6144 keys against 0.7 by
    the byte loop)."""
    n = mask.size
    body = n - n % 8
    words = mask[:body].view(np.uint64)
    total = 0
    for i in range(words.size):
        x = words[i]
        x += x >> np.uint64(8)
        x += x >> np.uint64(16)
        x += x >> np.uint64(32)
        total += np.int64(x & np.uint64(0xFF))
    for i in range(body, n):
        total += mask[i]
    return total


@njit(cache=True)
def least_used(
    held: np.ndarray,
    p_use: np.ndarray,
    lo: int,
    hi: int,
    cap: int,
    order: np.ndarray,
    state: np.ndarray,
) -> tuple[int, int, np.ndarray]:
    """Over ``held [L * E]`` (bool, C-contiguous): ``(held count, evictable count, the
    min(cap, evictable) smallest ``p_use`` of the held experts outside keys ``lo:hi``,
    ascending, float64)``.

    Before ``p_use`` is sorted: a branch-free pass counts the held experts and those of them no
    running request uses (``p_use`` 0); when the evictable ones include at least ``min(cap,
    evictable)`` such, the answer is that many zeros. Otherwise a second pass keeps a bounded
    max-heap of the ``cap`` smallest so far (``O(L E log cap)``): the pass that counted the held
    experts and the one that gathered their use into a partition of every held expert cost 30 us
    per planning layer at the Qwen3-30B-A3B shape (6144 keys, 1536 held); the heap pass about
    7 us at batch 1 (cap 8), the short cut 1.9 us (median over 200 plans' arguments of ``bench
    overhead``, gate open). (``np.partition`` of the gathered held use was no faster than the
    heap: 17 us at batch 16.)

    ``order [L * E]`` int32 and ``state [3]`` int64 (``order`` empty: always the heap; a ``[2]``
    state: no count of the calls to come) let the calls that share one ``p_use`` (the policy's,
    once per step) sort it once: ``order`` becomes ``p_use``'s argsort (``state[1]`` 1) when the
    heap work spent so far (``state[0]``, the values the heap passes kept) plus the work still
    expected (``state[2]``, the caller's count of the calls still to come with this ``p_use``,
    this one included, times this call's) reaches the sort's (:data:`HEAP_COST_PER_KEPT`), and
    later calls count the held experts (:func:`count_true`) and walk it from the smallest use
    until they have ``min(cap, evictable)`` held experts outside ``lo:hi``: the same values (the
    ``cap`` smallest of a multiset; the zeros first, so no short cut is needed), 5 us instead of
    17-20 at batch 16 (about 85 kept), for an 80 us sort. Without the caller's count (0) that is
    the ski rental: sort once the heaps spent what the sort costs, which keeps a step within
    twice the better of the two. The caller resets ``state[:2]`` when ``p_use`` changes.

    NOTE: the walk. At batch 16 it passes about 3,700 sorted keys to find about 88 held ones (the
    cache keeps the experts the batch uses: the least used are seldom held). Written branch-light
    (one test per key, the stop inside the hit) over the int32 order, with the count of
    :func:`count_true` instead of the counting pass, it took 8.1 us against 10.1 of the walk
    after the counting pass over int64 (600 plans' arguments of ``bench overhead``, batch 16,
    gate open, median of 7 passes; 15.2 against 23.2 with 1 MB of other data touched between
    calls)."""
    sortable = order.size == held.size
    if sortable and state[1] == 1:  # walk the sorted use
        n_held = count_true(held)
        pinned = 0
        for i in range(max(lo, 0), min(hi, held.size)):
            pinned += held[i]
        m_avail = n_held - pinned
        return n_held, m_avail, _walk_sorted(held, p_use, lo, hi, max(0, min(cap, m_avail)), order)
    n_held = 0
    zeros = 0
    for i in range(held.size):
        h = np.int64(held[i])
        n_held += h
        zeros += h * np.int64(p_use[i] == 0)
    pinned = 0
    for i in range(max(lo, 0), min(hi, held.size)):
        if held[i]:
            pinned += 1
            zeros -= np.int64(p_use[i] == 0)
    m_avail = n_held - pinned
    want = max(0, min(cap, m_avail))
    if zeros >= want:
        return n_held, m_avail, np.zeros(want)
    calls_left = state[2] if state.size > 2 else 0  # the caller's count, if it passes one
    heaps_dearer = state[0] + max(calls_left, 1) * want >= least_used_sort_work(held.size)
    if sortable and heaps_dearer:
        order[:] = np.argsort(p_use)
        state[1] = 1
        return n_held, m_avail, _walk_sorted(held, p_use, lo, hi, want, order)
    state[0] += want
    heap = np.empty(max(cap, 1))  # max-heap: heap[0] is the largest of the smallest kept
    k = 0
    for i in range(held.size):
        if not held[i] or lo <= i < hi:
            continue
        v = np.float64(p_use[i])
        if k < cap:  # sift up
            j = k
            k += 1
            while j > 0:
                parent = (j - 1) >> 1
                if heap[parent] >= v:
                    break
                heap[j] = heap[parent]
                j = parent
            heap[j] = v
        elif cap > 0 and v < heap[0]:  # replace the largest, sift down
            j = 0
            while True:
                c = 2 * j + 1
                if c >= k:
                    break
                if c + 1 < k and heap[c + 1] > heap[c]:
                    c += 1
                if heap[c] <= v:
                    break
                heap[j] = heap[c]
                j = c
            heap[j] = v
    return n_held, m_avail, np.sort(heap[:k])


@njit(cache=True)
def _walk_sorted(
    held: np.ndarray, p_use: np.ndarray, lo: int, hi: int, want: int, order: np.ndarray
) -> np.ndarray:
    """``[want]`` float64: ``p_use`` of the first ``want`` held experts outside keys ``lo:hi`` in
    ``order`` (``p_use``'s argsort: ascending), for :func:`least_used` (``want`` at most the
    evictable ones)."""
    out = np.empty(want)
    j = 0
    if want:
        for pos in range(order.size):
            idx = order[pos]
            if held[idx] & ((idx < lo) | (idx >= hi)):
                out[j] = p_use[idx]
                j += 1
                if j == want:
                    break
    return out


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) these kernels for the types the gate passes, once
    per process (off a planning layer's clock)."""
    global _warm
    if _warm:
        return
    held = np.zeros(2, dtype=np.bool_)
    no_order, state = np.zeros(0, dtype=np.int32), np.zeros(3, dtype=np.int64)
    for p_use in (np.zeros(2), np.zeros(2, dtype=np.float32)):
        least_used(held, p_use, 0, 1, 1, no_order, state)
    _warm = True
