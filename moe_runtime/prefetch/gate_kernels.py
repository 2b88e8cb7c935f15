"""Compiled (numba) kernels of the cost gate (ours; :mod:`moe_runtime.prefetch.gate`): rank a
plan's candidates, test each one's gain against its cost, order the plan, and keep the gate's
precision by layer distance and rank as the candidates' layers route.

A planning layer makes one call here after its prediction, :func:`limit_gate_plan`: it scores
the routed layer against the candidates earlier plans noted for it (:func:`score_noted`), blends
in the router lookahead and limits and weights the rows (``eam_kernels.blend``,
``eam_kernels.limit_scores``), ranks the candidates a prefetch would copy (:func:`ranked_free`),
tests them (:func:`gate_plan`: :func:`pays`, the victims' next-step use from
``victim_kernels.least_used``), notes them for their layers (:func:`note_candidates`) and writes
the paying ones as flat keys best first for the queue (``TransferQueue.replan_ranked``).

Each kernel is plain numpy-and-loops Python that numba compiles (``moe_runtime.jit``); its
``py_func`` is the reference ``tests/test_prefetch_kernels.py`` checks it against, with the numpy
each docstring names. See :mod:`moe_runtime.prefetch.eam_kernels` on why the plan is compiled,
and on numba's cache: the compiled :func:`limit_gate_plan` and :func:`gate_plan` keep the
``eam_kernels`` and ``victim_kernels`` code they call until this file changes.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.jit import njit
from moe_runtime.prefetch.eam_kernels import blend, limit_scores
from moe_runtime.prefetch.victim_kernels import least_used

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
    """The gate over a plan in one call (``GatedPlanning._paying``): the candidates of ``rows
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
    used = used_mask(ids.reshape(-1), figures.shape[2])
    for d in range(depth):
        for j in range(noted_n[layer, d]):
            r = noted[layer, d, 1, j]
            hits[d, r] = decay * hits[d, r] + (1.0 if used[noted[layer, d, 0, j]] else 0.0)
            trials[d, r] = decay * trials[d, r] + 1.0
            precision[d, r] = hits[d, r] / trials[d, r]
        noted_n[layer, d] = 0
    return total


@njit(cache=True)
def used_mask(ids: np.ndarray, size: int) -> np.ndarray:
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


_warm = False


def warm() -> None:
    """Compile (or load from numba's cache) these kernels for the types the gate and the ``eam``
    policy pass, once per process (off a planning layer's clock)."""
    global _warm
    if _warm:
        return
    rows = np.zeros((1, 2), dtype=np.float32)
    held = np.zeros(2, dtype=np.bool_)
    one = np.ones(1)
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
    one_id = np.zeros(1, dtype=np.int64)
    noted, noted_n = np.zeros((1, 1, 2, 2), dtype=np.int32), np.zeros((1, 1), dtype=np.int64)
    note_candidates(noted, noted_n, one_id, one_id, one_id, 0, 1)
    score_noted(np.ones((3, 1, 2)), noted, noted_n, 0, one_id.reshape(1, 1), 0.9)
    _warm = True
