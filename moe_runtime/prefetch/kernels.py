"""Compiled (numba) kernels of the prefetch plan: the per-candidate work of one planning layer.

NOTE: why compiled. A plan at the Qwen3-30B-A3B shape (48 layers, 128 experts, top-8) ranks,
gates and selects up to a few hundred candidates; written as numpy it was dozens of calls of about
a microsecond each per planning layer (the plan cost three to six times issue #15's 50 us budget
for a whole MoE layer). Each kernel here is one call. They compute exactly what the numpy code
they replaced computed (same float operations in the same order, stable sorts with the same tie
rules; only the runtime's host-time check sums in another order), so plans, and the
simulator's outputs, are bit-identical (``tools/sim_fingerprint.py``). They are the only
implementation: the runtime and the simulator both call them through the ``eam`` policy and
:meth:`moe_runtime.prefetch.base.PrefetchPolicy.issue`. ``cache=True`` keeps the machine code in
``__pycache__``, so only the first import on a host compiles (a few seconds).
"""

from __future__ import annotations

import numpy as np

from moe_runtime.io.transfer_queue import best_free  # noqa: F401  (the plan's best-k: the queue's)
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


# Rows with at most this many positive entries are ranked by an insertion sort, longer ones by
# counting, for each, the entries above it (and the equal ones before it): a branch-free pass the
# compiler vectorises. Per row of 128 experts (4,000 distinct random rows each, call included;
# a benchmark that repeats a few rows trains the branch predictor and flatters the sorts): 128
# positive 4.7 us by insertion, 4.3 by a sort of packed (value, column) keys, 2.8 by counting;
# 90 positive 3.6 / 3.6 / 2.5; 32 positive 1.8 / 2.1 / 1.6; 8 positive 1.1 / 1.4 / 1.3.
INSERTION_MAX = 16


@njit(cache=True)
def ranked_free(rows: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positive entries of ``rows [D, E]`` not ``held [D, E]`` as ``(row, column, rank)``,
    row-major; ``rank`` is the entry's place in its row by falling value over all positive
    entries (held ones too; 0 = largest, ties: lower column first)."""
    D, E = rows.shape
    r = np.empty(D * E, dtype=np.int64)
    c = np.empty(D * E, dtype=np.int64)
    rank = np.empty(D * E, dtype=np.int64)
    pos = np.empty(E, dtype=np.int64)  # a row's positive columns, best first
    inv = np.empty(E, dtype=np.int64)
    n = 0
    for d in range(D):
        row = rows[d]
        m = 0
        for e in range(E):
            if row[e] > 0:
                pos[m] = e
                m += 1
        if m <= INSERTION_MAX:  # columns come ascending: a stable insertion by falling value
            for i in range(1, m):
                e = pos[i]
                v = row[e]
                j = i
                while j > 0 and row[pos[j - 1]] < v:
                    pos[j] = pos[j - 1]
                    j -= 1
                pos[j] = e
            for j in range(m):
                inv[pos[j]] = j
        else:  # a candidate's rank: the entries above it, and the equal ones in a lower column
            for e in range(E):
                v = row[e]
                if v > 0 and not held[d, e]:
                    above = 0
                    for f in range(E):
                        above += row[f] > v
                    for f in range(e):
                        above += row[f] == v
                    r[n], c[n], rank[n] = d, e, above
                    n += 1
            continue
        for e in range(E):
            if row[e] > 0 and not held[d, e]:
                r[n], c[n], rank[n] = d, e, inv[e]
                n += 1
    return r[:n], c[:n], rank[:n]


@njit(cache=True)
def plan_order(r: np.ndarray, c: np.ndarray, rank: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """``[n]`` the candidates ``(r, c, rank)`` of :func:`ranked_free` in the plan's order: falling
    ``scores [D, E]``, ties in candidate order (a stable sort). With one row (the default plan
    depth) the ranks already order the candidates by falling value, and a score is its value
    times the row's weight, rounded (monotone), so the ranks' order needs only the ties in score
    put back in candidate order: an insertion pass over an almost sorted list instead of a sort."""
    n = r.size
    if n == 0 or scores.shape[0] > 1:
        neg = np.empty(n, dtype=scores.dtype)
        for i in range(n):
            neg[i] = -scores[r[i], c[i]]
        return np.argsort(neg, kind="mergesort")
    E = scores.shape[1]
    slot = np.full(E, -1, dtype=np.int64)
    for i in range(n):
        slot[rank[i]] = i
    order = np.empty(n, dtype=np.int64)
    k = 0
    for j in range(E):
        if slot[j] >= 0:
            order[k] = slot[j]
            k += 1
    row = scores[0]
    for i in range(1, n):  # (falling score, candidate) order; moves only ties in score
        x = order[i]
        v = row[c[x]]
        j = i
        while j > 0 and (row[c[order[j - 1]]] < v or (row[c[order[j - 1]]] == v and order[j - 1] > x)):
            order[j] = order[j - 1]
            j -= 1
        order[j] = x
    return order


@njit(cache=True)
def pays(
    p_used: np.ndarray,
    block_s: float,
    busy: float,
    transfer_s: float,
    reuse: np.ndarray,
    force_open: bool,
    idle: np.ndarray,
    idle_save_s: float,
    copy_host_s: float,
) -> tuple[np.ndarray, float]:
    """``([n] bool, net)``: whether gain ``p * b * (1 - q)`` beats cost ``(1 - p) * q * t +
    reuse * b + h`` for each candidate (``PrefetchGate.pays`` documents the terms), or, for the
    candidates marked ``idle`` (``[n]`` bool: their copies fit in the link time demand copies
    leave idle), whether gain ``p * b`` beats cost ``reuse * b + h``; all True with
    ``force_open``. ``h``: ``copy_host_s``, the compute thread's time one copy's I/O-thread
    work takes from it (0 in the simulator). ``net``: the summed ``gain - cost`` of the
    candidates that pay (seconds saved)."""
    n = p_used.size
    keep = np.empty(n, dtype=np.bool_)
    net = 0.0
    for i in range(n):
        if idle[i]:
            gain = p_used[i] * idle_save_s
            cost = reuse[i] * block_s + copy_host_s
        else:
            gain = p_used[i] * block_s * (1.0 - busy)
            cost = (1.0 - p_used[i]) * busy * transfer_s + reuse[i] * block_s + copy_host_s
        keep[i] = gain > cost
        if keep[i]:
            net += gain - cost
    if force_open:
        keep[:] = True
    return keep, net


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


@njit(cache=True)
def gate_plan(
    rows: np.ndarray,
    scores: np.ndarray,
    held_rows: np.ndarray,
    distance0: int,
    precision: np.ndarray,
    block_s: float,
    busy: float,
    transfer_s: float,
    force_open: bool,
    held: np.ndarray,
    p_use: np.ndarray,
    layer: int,
    num_experts: int,
    num_slots: int,
    idle_copies: float,
    idle_save_s: float,
    copy_host_s: float,
    use_order: np.ndarray,
    use_state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """The gate over a plan in one call (``EAMPrefetch._paying``): the candidates of ``rows
    [D, E]`` a prefetch would copy (not ``held_rows [D, E]``), ranked as :func:`ranked_free` ranks
    them, and which of them pass the gain/cost test (:func:`pays`).

    ``scores [D, E]``: the plan's scores (their order is the plan's order); ``distance0``: layers
    from the routed one to row 0; ``precision [Dg, E]``: the gate's running precision by distance
    and rank; ``block_s``, ``busy``, ``transfer_s``: ``b``, ``q`` and ``t``; ``held [L * E]``,
    ``p_use [L * E]`` (empty: no reuse term): the victims'
    next-step use (the i-th prefetch in plan order, best score first, evicts the i-th least used
    held expert not of ``layer`` once ``num_slots`` are full); ``idle_copies``: copies that fit in
    the link time demand copies leave idle per planning layer (``PrefetchGate.idle_copies``): the
    first ``int(idle_copies)`` in plan order are tested as ``idle`` (:func:`pays`);
    ``copy_host_s``: ``h`` of :func:`pays`; ``use_order``, ``use_state``: :func:`least_used`'s
    sort of ``p_use`` (empty: none).

    Returns ``(r, c, rank, keep, order, net)``: the candidates (for ``PrefetchGate.note``),
    ``[n]`` bool which pay, ``[n]`` the candidates in the plan's order (:func:`plan_order`), and
    the paying candidates' summed ``gain - cost`` (:func:`pays`).
    """
    r, c, rank = ranked_free(rows, held_rows)
    n = r.size
    depth = precision.shape[0]
    p_used = np.empty(n)
    for i in range(n):
        d = min(distance0 + r[i], depth) - 1
        p_used[i] = precision[d, rank[i]]
    reuse = np.zeros(n)
    order = plan_order(r, c, rank, scores)  # the plan's order: best first
    idle = np.zeros(n, dtype=np.bool_)  # the first ones fit in the link's idle time
    for j in range(min(n, int(idle_copies))):
        idle[order[j]] = True
    keep, net = pays(p_used, block_s, busy, transfer_s, reuse, force_open, idle, idle_save_s, copy_host_s)
    # An eviction only adds cost, so only the candidates that pay without it can pay with it, and
    # the i-th in plan order takes the i-th victim: the victims up to the last of those decide.
    last = 0  # plan-order positions 0 .. last - 1 hold every candidate that pays so far
    for j in range(n):
        if keep[order[j]]:
            last = j + 1
    if last and p_use.size:
        # the running layer's experts are pinned: never victims
        lo, hi = layer * num_experts, (layer + 1) * num_experts
        n_held, m_avail, least = least_used(held, p_use, lo, hi, last, use_order, use_state)
        free = max(0, num_slots - n_held)
        if last > free:
            victims = np.zeros(n)  # free slots first (no reuse), then the least used held experts
            m = min(last - free, m_avail)
            if m > 0:
                victims[free : free + m] = least[:m]
            victims[free + max(m, 0) :] = 1.0  # nothing left to evict: it cannot be placed anyway
            for j in range(n):
                reuse[order[j]] = victims[j]
            keep, net = pays(
                p_used, block_s, busy, transfer_s, reuse, force_open, idle, idle_save_s, copy_host_s
            )
    return r, c, rank, keep, order, net


def gate_terms(
    ahead_weight: float,
    block_s: float,
    busy: float,
    transfer_s: float,
    force_open: bool,
    num_slots: int,
    idle_copies: float,
    idle_save_s: float,
    copy_host_s: float,
    decay: float,
) -> np.ndarray:
    """:func:`limit_gate_plan`'s ``terms [10]`` (float64, in the order of the arguments;
    ``force_open`` 0 or 1, ``num_slots`` exact below 2**53): the scalars of a plan that change
    only at a step's end, in one array rather than ten arguments (numba's dispatcher types each
    argument at every call: a scalar cost about 0.2 us of a planning layer at batch 16, cold).
    ``decay``: the gate's (``PrefetchGate.decay``), for the scoring :func:`score_noted` does."""
    return np.array(
        [ahead_weight, block_s, busy, transfer_s, float(force_open), num_slots]
        + [idle_copies, idle_save_s, copy_host_s, decay]
    )


@njit(cache=True)
def limit_gate_plan(
    probs: np.ndarray,
    ahead: np.ndarray,
    weights: np.ndarray,
    held: np.ndarray,
    figures: np.ndarray,
    noted: np.ndarray,
    noted_n: np.ndarray,
    routed: np.ndarray,
    p_use: np.ndarray,
    use_order: np.ndarray,
    use_state: np.ndarray,
    terms: np.ndarray,
    out_keys: np.ndarray,
    out_priorities: np.ndarray,
    cap: int,
    min_prob: float,
    first_key: int,
    distance0: int,
    layer: int,
) -> tuple[int, float, int]:
    """A planning layer's one compiled call between prediction and the queue: the gate's
    scoring of the routed layer (:func:`score_noted`), then :func:`blend`, :func:`limit_scores`
    and :func:`gate_plan`, then the gate's note of the candidates (:func:`note_candidates`).

    ``routed [T, k]`` (int64, C-contiguous): layer ``layer``'s routing, scored against the
    candidates noted for it in ``noted``/``noted_n`` (the gate's, updating its ``figures [3, D,
    E]``) before the plan reads the precision ``figures[2]``. ``probs [D, E]``
    with the router lookahead ``ahead [d, E]`` (``d <= D``; ``d`` 0: none) blended in at
    ``terms``' ``ahead_weight``, limited to each row's ``cap`` largest at or above ``min_prob``
    (``cap`` 0, ``min_prob`` 0: already limited) and weighted by ``weights [D]``; the plan's rows
    are flat keys ``first_key .. first_key + D * E - 1`` (``first_key`` a multiple of ``E``),
    whose ``held`` entries (``held [L * E]``) are the rows' held mask. ``terms``:
    :func:`gate_plan`'s scalars that change only at a step's end and the gate's decay, as
    :func:`gate_terms` packs them. The candidates a prefetch would copy are noted for their
    layers, ``distance0 + r`` layers ahead.

    Writes the plan to ``out_keys[:m]`` (int64) and ``out_priorities[:m]`` (float64; both at
    least ``D * E`` long): the paying candidates with a positive score as flat keys in the
    plan's order, best first (falling score, ties in ascending key: the order
    ``TransferQueue.replan_best`` would pick them from the paying scores), and their scores,
    which the queue takes as priorities (``TransferQueue.replan_ranked``). Returns ``(m, net,
    scored)``: the plan's length, :func:`gate_plan`'s net and how many noted candidates were
    scored. Scalars only: each array handed back to Python costs about a microsecond, and
    scoring and noting here save the two Python calls around the plan (about 5 us of a
    planning layer at batch 16, in place)."""
    ahead_weight, block_s, busy, transfer_s = terms[0], terms[1], terms[2], terms[3]
    force_open, num_slots = terms[4] != 0.0, int(terms[5])
    idle_copies, idle_save_s, copy_host_s, decay = terms[6], terms[7], terms[8], terms[9]
    scored = score_noted(figures, noted, noted_n, layer, routed, decay)
    if ahead.shape[0]:
        probs = blend(probs, ahead, ahead_weight)
    rows, scores = limit_scores(probs, cap, min_prob, weights)
    held_rows = held[first_key : first_key + rows.size].reshape(rows.shape)
    E = probs.shape[1]
    r, c, rank, keep, order, net = gate_plan(
        rows, scores, held_rows, distance0, figures[2], block_s, busy, transfer_s, force_open, held,
        p_use, layer, E, num_slots, idle_copies, idle_save_s, copy_host_s, use_order, use_state,
    )  # fmt: skip
    note_candidates(noted, noted_n, r, c, rank, first_key // E, distance0)
    m = 0
    for j in range(r.size):
        i = order[j]
        v = scores[r[i], c[i]]
        if keep[i] and v > 0:
            out_keys[m] = first_key + r[i] * E + c[i]
            out_priorities[m] = v
            m += 1
    return m, net, scored


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


@njit(cache=True)
def score_noted(
    figures: np.ndarray, noted: np.ndarray, noted_n: np.ndarray, layer: int, ids: np.ndarray, decay: float
) -> int:
    """``PrefetchGate.observe``, in place: layer ``layer`` routed ``ids [T, k]`` (int64,
    C-contiguous; negative: none); score the candidates noted for it (:func:`note_candidates`) and forget
    them. ``figures [3, D, E]`` (float64): the gate's hits, trials and precision by (distance,
    rank); ``noted [L, D, 2, E]`` (int32): per layer and distance ``d`` (row ``d - 1``), the
    noted candidates' experts (row 0) and ranks (row 1), ``noted_n [L, D]`` of them. A candidate
    (expert ``c``, ranked ``r`` by its plan, distinct within its group) counts as a hit if
    ``c`` is among ``ids``: ``hits[d - 1, r] = decay * hits[d - 1, r] + used``, ``trials[d - 1,
    r] = decay * trials[d - 1, r] + 1``, and ``precision[d - 1, r] = hits / trials`` kept
    current with them (the gate reads it at every plan: no ``[D, E]`` division per planning
    layer). Returns how many candidates were scored. A layer outside ``0 .. L - 1`` scores none."""
    if layer < 0 or layer >= noted_n.shape[0]:
        return 0
    depth = noted_n.shape[1]
    total = 0
    for d in range(depth):
        total += noted_n[layer, d]
    if total == 0:
        return 0
    hits, trials, precision = figures[0], figures[1], figures[2]
    used = _used_mask(ids.reshape(-1), figures.shape[2])
    for d in range(depth):
        for j in range(noted_n[layer, d]):
            r = noted[layer, d, 1, j]
            hits[d, r] = decay * hits[d, r] + (1.0 if used[noted[layer, d, 0, j]] else 0.0)
            trials[d, r] = decay * trials[d, r] + 1.0
            precision[d, r] = hits[d, r] / trials[d, r]
        noted_n[layer, d] = 0
    return total


@njit(cache=True)
def _used_mask(ids: np.ndarray, size: int) -> np.ndarray:
    """``[size]`` bool: which experts the routed ``ids [n]`` (int64, each ``< size``; negative:
    none) chose."""
    used = np.zeros(size, dtype=np.bool_)
    for i in range(ids.size):
        if ids[i] >= 0:
            used[ids[i]] = True
    return used


@njit(cache=True)
def note_candidates(
    noted: np.ndarray,
    noted_n: np.ndarray,
    r: np.ndarray,
    c: np.ndarray,
    rank: np.ndarray,
    first_layer: int,
    distance0: int,
) -> None:
    """``PrefetchGate.note``, in place: candidate ``i`` (expert ``c[i]`` of layer ``first_layer +
    r[i]``, ranked ``rank[i]`` in its layer's row, ``distance0 + r[i]`` layers ahead of the routed
    one; int64 ``[n]`` each) is kept in ``noted``/``noted_n`` (:func:`score_noted`) for that
    layer and distance when the distance is ``1 .. D`` and the layer ``< L``. A layer and
    distance holds at most ``E`` candidates (one plan's row; a second plan for the same pair
    before the layer routes cannot happen within a step): any beyond are dropped."""
    L, depth, _, E = noted.shape
    for i in range(r.size):
        d = distance0 + r[i]
        t = first_layer + r[i]
        if 1 <= d <= depth and 0 <= t < L:
            m = noted_n[t, d - 1]
            if m < E:
                noted[t, d - 1, 0, m] = c[i]
                noted[t, d - 1, 1, m] = rank[i]
                noted_n[t, d - 1] = m + 1


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
    used = _used_mask(ids, size)
    diff = 0
    for e in with_term:
        if e < size and used[e]:
            diff += 1
    for e in without_term:
        if e < size and used[e]:
            diff -= 1
    return diff


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
    (``EAMPrefetch._note_eamc_term``, ``moe_runtime.prefetch.term_value``) in one call:
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
    """Compile (or load from the on-disk cache) every kernel for the types the policies pass,
    once per process: the first call of a kernel otherwise costs up to a second, which would
    land on a planning layer's clock."""
    global _warm
    if _warm:
        return
    rows = np.zeros((1, 2), dtype=np.float32)
    held = np.zeros(2, dtype=np.bool_)
    one = np.ones(1)
    best_free(rows.reshape(-1), held, 1)
    best_free(one, held[:1], 1)  # float64 scores (baselines)
    limit_scores(rows, 1, 0.0, one)
    ranked_free(rows, held.reshape(1, 2))
    pays(one, 1.0, 0.0, 1.0, one, False, held[:1], 1.0, 0.0)
    no_order, state = np.zeros(0, dtype=np.int32), np.zeros(3, dtype=np.int64)
    for p_use in (np.zeros(0), np.zeros(2, dtype=np.float32)):
        args = (1.0, 0.0, 1.0, False, held, p_use, 0, 2, 1, 0.0, 1.0, 0.0, no_order, state)
        gate_plan(rows, rows, held.reshape(1, 2), 1, one.reshape(1, 1), *args)
        terms = gate_terms(1.0, 1.0, 0.0, 1.0, False, 1, 0.0, 1.0, 0.0, 0.98)
        figures = np.ones((3, 1, 2))
        noted, noted_n = np.zeros((1, 1, 2, 2), dtype=np.int32), np.zeros((1, 1), dtype=np.int64)
        routed = np.zeros((1, 1), dtype=np.int64)
        for ahead in (rows, rows[:0]):
            limit_gate_plan(
                rows, ahead, one, held, figures, noted, noted_n, routed, p_use, no_order, state, terms,
                np.zeros(2, dtype=np.int64), np.zeros(2), 1, 0.0, 0, 1, 0,
            )  # fmt: skip
    blend(rows, rows, 2.0)
    row_probs(rows)  # the policy's own term, once per step (eam._row_probs)
    match_counts(rows, 1)
    for p_use in (np.zeros(2), np.zeros(2, dtype=np.float32)):
        least_used(held, p_use, 0, 1, 1, no_order, state)
    one_id = np.zeros(1, dtype=np.int64)
    used_difference(one_id, one_id, one_id)
    noted, noted_n = np.zeros((1, 1, 2, 2), dtype=np.int32), np.zeros((1, 1), dtype=np.int64)
    note_candidates(noted, noted_n, one_id, one_id, one_id, 0, 1)
    score_noted(np.ones((3, 1, 2)), noted, noted_n, 0, one_id.reshape(1, 1), 0.9)
    entries = np.zeros((1, 1, 2), dtype=np.float32)
    entries.flags.writeable = False  # EAMC.entries() is a read-only view
    matched_row_probs(entries, np.ones(1, dtype=np.int64), 0, 1)
    own_plus_eamc(rows, rows)
    own_plus_eamc(rows, rows[:0])
    for ahead in (rows, rows[:0]):
        term_candidates(rows, rows, ahead, 1.0, held, 1)
    _warm = True
