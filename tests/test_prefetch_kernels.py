"""The prefetch plan's compiled kernels (``moe_runtime.prefetch.eam_kernels``, ``gate_kernels``,
``victim_kernels``) equal the numpy code they replaced and their own plain Python (``py_func``),
bit for bit, on random inputs full of ties, held keys and zero rows."""

from __future__ import annotations

import numpy as np
import pytest

import moe_runtime.prefetch.eam_kernels as eam_kernels
import moe_runtime.prefetch.gate_kernels as gate_kernels
import moe_runtime.prefetch.victim_kernels as victim_kernels
from moe_runtime.io.transfer_queue import best_free
from moe_runtime.prefetch.gate import PrefetchGate


def _ties(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values in eighths, a third of them zero: many equal entries."""
    x = rng.integers(0, 8, size=shape).astype(np.float32) / 8
    x[rng.random(shape) < 0.33] = 0
    return x


@pytest.mark.parametrize("seed", range(20))
def test_best_free_is_a_stable_descending_selection(seed: int) -> None:
    rng = np.random.default_rng(seed)
    flat = _ties(rng, (int(rng.integers(1, 700)),))
    held = rng.random(flat.size) < 0.3
    k = int(rng.integers(1, 300))
    cand = ((flat > 0) & ~held).nonzero()[0]
    order = (-flat[cand]).argsort(kind="stable")[:k]  # the numpy plan it replaced
    keys, vals = best_free(flat, held, k)
    np.testing.assert_array_equal(keys, cand[order])
    np.testing.assert_array_equal(vals, flat[cand[order]])
    assert vals.dtype == np.float32


@pytest.mark.parametrize("seed", range(20))
def test_limit_scores_keeps_each_rows_cap_largest_and_weights_them(seed: int) -> None:
    rng = np.random.default_rng(seed)
    probs = _ties(rng, (int(rng.integers(1, 4)), 16))
    cap, min_prob = int(rng.integers(0, 20)), float(rng.choice([0.0, 0.25]))
    weights = rng.random(len(probs))
    want = np.where(probs >= min_prob, probs, 0.0) if min_prob > 0 else probs
    if 0 < cap < probs.shape[1]:
        kth = -np.partition(-want, cap - 1, axis=1)[:, cap - 1 : cap]
        want = np.where(want >= kth, want, 0.0)
    rows, scores = eam_kernels.limit_scores(probs, cap, min_prob, weights)
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(scores, (want * weights[:, None]).astype(np.float32))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("width", [12, gate_kernels.INSERTION_MAX + 72])  # insertion / counting
def test_ranked_free_ranks_over_the_whole_row_and_drops_held(seed: int, width: int) -> None:
    rng = np.random.default_rng(seed)
    rows = _ties(rng, (3, width)) if seed % 2 else rng.random((3, width)).astype(np.float32)
    held = rng.random(rows.shape) < 0.3
    full = np.empty(rows.shape, dtype=np.int64)
    np.put_along_axis(full, np.argsort(-rows, axis=1, kind="stable"), np.arange(width)[None, :], axis=1)
    r, c, rank = gate_kernels.ranked_free(rows, held)
    want_r, want_c = ((rows > 0) & ~held).nonzero()
    np.testing.assert_array_equal(r, want_r)
    np.testing.assert_array_equal(c, want_c)
    np.testing.assert_array_equal(rank, full[r, c])


@pytest.mark.parametrize("seed", range(30))
def test_plan_order_is_a_stable_sort_by_falling_score(seed: int) -> None:
    """With one row the order comes from the ranks plus an insertion pass over ties in score; it
    must equal the stable sort, also where the weight's rounding makes distinct values equal."""
    rng = np.random.default_rng(seed)
    D, E = (1 if seed % 3 else 2), int(rng.integers(1, 160))
    rows = _ties(rng, (D, E)) if seed % 2 else rng.random((D, E)).astype(np.float32)
    if seed % 5 == 0:  # values one float32 step apart, which a small weight rounds together
        rows[0] = np.float32(0.3) + np.arange(E, dtype=np.float32) % 3 * np.finfo(np.float32).eps
    weights = rng.random(D) * (1e-30 if seed % 7 == 0 else 1.0)
    rows, scores = eam_kernels.limit_scores(rows, 0, 0.0, weights)
    held = rng.random((D, E)) < 0.3
    r, c, rank = gate_kernels.ranked_free(rows, held)
    want = np.argsort(-scores[r, c], kind="stable")
    np.testing.assert_array_equal(gate_kernels.plan_order(r, c, rank, scores), want)


def _gate_keep_numpy(
    r, c, rank, scores, d0, prec, b, q, t, held, p_use, layer, E, slots, idle_n, save, h=0.0
):  # noqa: ANN001, ANN202, E501
    """The numpy gate (``GatedPlanning._paying`` with ``_victim_use``): ``(keep, net)``; the plan's
    best ``idle_n`` candidates are tested without the link terms, each right one saving ``save``;
    ``h``: each copy's host cost."""
    p_used = prec[np.minimum(d0 + r, prec.shape[0]) - 1, rank]
    order = (-scores[r, c]).argsort(kind="stable")
    qs = np.ones(r.size)
    qs[order[:idle_n]] = 0.0  # 0: an idle-link candidate

    def pays(reuse: np.ndarray) -> tuple[np.ndarray, float]:
        gain = np.where(qs == 0.0, p_used * save, p_used * b * (1.0 - q))
        cost = np.where(qs == 0.0, reuse * b, (1.0 - p_used) * q * t + reuse * b) + h
        keep = gain > cost
        return keep, float((gain - cost)[keep].sum())

    reuse = np.zeros(r.size)
    if not pays(reuse)[0].any():
        return pays(reuse)
    n = r.size
    n_held = int(held.sum())
    free = max(0, slots - n_held)
    victims = np.zeros(n)
    if n > free and p_use.size:
        p = np.where(held, p_use, np.inf)
        p[layer * E : (layer + 1) * E] = np.inf
        m = min(n - free, n_held - int(held[layer * E : (layer + 1) * E].sum()))
        if m > 0:
            victims[free : free + m] = np.sort(np.partition(p, m - 1)[:m])
        victims[free + max(m, 0) :] = 1.0
    reuse[order] = victims
    return pays(reuse)


@pytest.mark.parametrize("seed", range(12))
def test_limit_gate_plan_is_limit_scores_then_gate_plan(seed: int) -> None:
    """The planning layer's one call equals its kernels in turn, packed: the gate's scoring of
    the routed layer, the router lookahead's blend (half the seeds), the limit, the gate and the
    gate's note of the candidates (its state as ``PrefetchGate.observe`` and ``note`` leave it); the plan
    (the paying candidates' keys best first, as ``best_free`` picks them from the paying scores,
    and their scores as priorities) and the net."""
    rng = np.random.default_rng(seed)
    L, E, D = 6, 16, int(rng.integers(1, 3))
    layer = int(rng.integers(0, L - D))
    lo = layer + 1
    probs = _ties(rng, (D, E))
    ahead = (rng.random((int(rng.integers(1, D + 1)) if seed % 2 else 0, E)) * 4).astype(np.float32)
    blended = eam_kernels.blend(probs, ahead, 0.7) if len(ahead) else probs
    cap, min_prob = int(rng.integers(1, E + 1)), float(rng.choice([0.0, 0.3]))
    if seed % 3 == 0:  # rows already limited: weights only
        cap, min_prob = 0, 0.0
    weights = rng.random(D)
    held = rng.random(L * E) < rng.random()
    prec = rng.random((D, E))
    b, q, t = float(rng.random()), float(rng.random()), float(rng.random())
    p_use = rng.random(L * E).astype(np.float32) if seed % 2 else np.zeros(0)
    slots = int(rng.integers(1, L * E))
    idle, save = float(rng.choice([0.0, 2.7])), float(rng.random())
    h = float(rng.choice([0.0, 0.05]))  # the copy's host cost
    force = seed % 4 == 1
    rows, scores = eam_kernels.limit_scores(blended, cap, min_prob, weights)
    held_rows = held[lo * E : (lo + D) * E].reshape(D, E)
    tail = (layer, E, slots, idle, save, h)
    terms = gate_kernels.gate_terms(0.7, b, q, t, force, slots, idle, save, h, 0.9)
    # the gate's state: candidates noted for the routed layer at distance 1, scored first
    gate = PrefetchGate(L, E, D, decay=0.9)
    gate.precision()[:] = prec
    gate.hits[:], gate.trials[:] = prec, 1.0
    noted_r = rng.permutation(E)[: int(rng.integers(0, E))].astype(np.int64)
    gate.note(1, layer, np.stack([np.zeros_like(noted_r), noted_r, rng.permutation(E)[: noted_r.size]]))
    routed = rng.integers(0, E, size=(3, 2)).astype(np.int64)
    want_gate = PrefetchGate(L, E, D, decay=0.9)
    for x, y in zip(want_gate.plan_state(), gate.plan_state(), strict=True):
        x[:] = y
    want_gate.observe(layer, routed)
    r, c, rank, keep, _, net = gate_kernels.gate_plan(
        rows, scores, held_rows, 1, want_gate.precision(), b, q, t, force, held, p_use, *tail,
        np.zeros(L * E, dtype=np.int32), _sort_now(),
    )  # fmt: skip
    want_gate.note(1, lo, np.stack([r, c, rank]))
    keys, priorities = np.full(D * E, -1, dtype=np.int64), np.full(D * E, -1.0)
    m, net2, scored = gate_kernels.limit_gate_plan(
        probs, ahead, weights, held, *gate.plan_state(), routed, p_use, np.zeros(L * E, dtype=np.int32),
        _sort_now(), terms, keys, priorities, cap, min_prob, lo * E, 1, layer,
    )  # fmt: skip
    assert (keys[m:] == -1).all() and (priorities[m:] == -1).all()  # written up to the plan's length
    keys, priorities = keys[:m], priorities[:m]
    assert scored == noted_r.size
    for got, want in zip(gate.plan_state(), want_gate.plan_state(), strict=True):
        np.testing.assert_array_equal(got, want)  # scored, then the plan's candidates noted
    paying = np.zeros_like(scores)  # the paying candidates' scores, every other entry 0
    paying[r[keep], c[keep]] = scores[r[keep], c[keep]]
    want_keys, want_scores = best_free(paying.reshape(-1), held[lo * E : (lo + D) * E], L * E)
    np.testing.assert_array_equal(keys, want_keys + lo * E)
    assert priorities.dtype == np.float64
    np.testing.assert_array_equal(priorities, want_scores.astype(np.float64))
    assert net2 == net


@pytest.mark.parametrize("seed", range(30))
def test_gate_plan_equals_the_numpy_gate(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L, E, D = 6, 16, int(rng.integers(1, 3))
    layer = int(rng.integers(0, L - D))
    rows = _ties(rng, (D, E))
    scores = (rows * rng.random(D)[:, None]).astype(np.float32)
    held = rng.random(L * E) < rng.random()
    lo = layer + 1
    held_rows = held[lo * E : (lo + D) * E].reshape(D, E)
    prec = rng.random((D, E))
    b, q, t = float(rng.random()), float(rng.random()), float(rng.random())
    p_use = rng.random(L * E).astype(np.float32) if seed % 3 else np.zeros(0)
    slots = int(rng.integers(1, L * E))
    idle = float(rng.choice([0.0, 0.5, 2.7, 100.0]))  # copies that fit in idle link time
    save = float(rng.random())
    h = float(rng.choice([0.0, 0.02, 0.2]))  # each copy's host cost
    # victims by the heap, or (even seeds) by the walk of p_use's sort (victim_kernels.least_used)
    order = np.zeros(L * E if seed % 2 == 0 else 0, dtype=np.int32)
    args = (b, q, t, False, held, p_use, layer, E, slots, idle, save, h, order, _sort_now())
    r, c, rank, keep, order, net = gate_kernels.gate_plan(rows, scores, held_rows, 1, prec, *args)
    np.testing.assert_array_equal(np.stack([r, c, rank]), np.stack(gate_kernels.ranked_free(rows, held_rows)))
    want, want_net = _gate_keep_numpy(
        r, c, rank, scores, 1, prec, b, q, t, held, p_use, layer, E, slots, int(idle), save, h
    )
    np.testing.assert_array_equal(keep, want)
    assert net == pytest.approx(want_net, rel=1e-12, abs=1e-15)
    # the plan's order: falling score, ties in candidate (row-major) order
    np.testing.assert_array_equal(order, np.argsort(-scores[r, c], kind="stable"))
    forced = gate_kernels.gate_plan(rows, scores, held_rows, 1, prec, b, q, t, True, *args[4:])[3]
    assert forced.all()


@pytest.mark.parametrize("seed", range(20))
def test_least_used_is_the_sorted_smallest_use_of_the_evictable_held_experts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L, E = int(rng.integers(1, 12)), 16
    held = rng.random(L * E) < rng.random()
    p_use = _ties(rng, (L * E,)) if seed % 2 else rng.random(L * E)  # float32 with ties, float64
    if seed % 3 == 0:  # experts no request uses (p 0), often more than cap: the zeros' short cut
        p_use[rng.random(L * E) < rng.random()] = 0
    layer, cap = int(rng.integers(0, L)), int(rng.integers(0, 40))
    evictable = held.copy()
    evictable[layer * E : (layer + 1) * E] = False  # the running layer's experts are pinned
    want = np.sort(p_use[evictable].astype(np.float64))[:cap]
    order = np.zeros(L * E, dtype=np.int32)
    hint = np.array([0, 0, 10], dtype=np.int64)  # ten calls expected: sorts at once (unless zeros)
    # the heap; the heap until it spent the sort's work, then the walk of p_use's sort; the walk at once
    for use_order, state in ((order[:0], _sort_now()), (order, np.zeros(3, dtype=np.int64)), (order, hint)):
        for _ in range(4):
            n_held, m_avail, least = victim_kernels.least_used(
                held, p_use, layer * E, (layer + 1) * E, cap, use_order, state
            )
            assert n_held == held.sum() and m_avail == evictable.sum()
            np.testing.assert_array_equal(least, want)
            assert least.dtype == np.float64
        heaps_ran = min(cap, evictable.sum()) > (p_use[evictable] == 0).sum()  # no zeros' short cut
        if (
            use_order.size
            and heaps_ran
            and (state[2] or state[0] >= victim_kernels.least_used_sort_work(L * E))
        ):
            assert state[1] == 1 and (np.diff(p_use[order]) >= 0).all()
            order[:] = 0
        if state is hint and heaps_ran:
            assert state[0] == 0  # sorted before any heap pass


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 6144, 6151])
def test_count_true_counts_eight_bytes_at_a_time_and_the_tail(size: int) -> None:
    """``victim_kernels.count_true`` (least_used's held count) equals numpy's count at sizes with and
    without a tail of fewer than eight entries, compiled and as plain Python, on dense and sparse
    masks (a word of eight True sums to 8 in its low byte: no carry)."""
    rng = np.random.default_rng(size)
    for density in (0.0, 0.3, 1.0):
        mask = rng.random(size) < density
        assert (
            victim_kernels.count_true(mask)
            == victim_kernels.count_true.py_func(mask)
            == np.count_nonzero(mask)
        )


def _sort_now() -> np.ndarray:
    """A ``least_used`` state that sorts at its next heap pass (when it is given an order)."""
    return np.array([1 << 40, 0, 0], dtype=np.int64)


@pytest.mark.parametrize("seed", range(10))
def test_score_noted_equals_the_fancy_indexed_update(seed: int) -> None:
    """``gate_kernels.score_noted`` scores each distance's noted group as numpy's fancy-indexed update
    does, keeps the precision current in place, forgets the layer's groups and leaves the other
    layers' alone."""
    rng = np.random.default_rng(seed)
    L, D, E, T, k = 4, 3, 16, int(rng.integers(1, 6)), 2
    hits, trials = rng.random((D, E)), rng.random((D, E)) + 1
    layer = int(rng.integers(0, L))
    noted = np.zeros((L, D, 2, E), dtype=np.int32)
    noted_n = rng.integers(0, E, size=(L, D)).astype(np.int64)
    for t in range(L):
        for d in range(D):  # distinct experts and ranks within a group, as noted
            noted[t, d] = np.stack([rng.permutation(E), rng.permutation(E)])
    ids = rng.integers(-1, E, size=(T, k)).astype(np.int64)
    used = np.zeros(E, dtype=bool)
    used[ids[ids >= 0]] = True
    want_h, want_t = hits.copy(), trials.copy()  # the numpy form, one distance at a time
    for d in range(D):
        n = noted_n[layer, d]
        experts, ranks = noted[layer, d, 0, :n], noted[layer, d, 1, :n]
        want_h[d, ranks] = 0.9 * want_h[d, ranks] + used[experts]
        want_t[d, ranks] = 0.9 * want_t[d, ranks] + 1.0
    figures = np.stack([hits, trials, hits / trials])
    want_n = noted_n.copy()
    want_n[layer] = 0
    before = int(noted_n[layer].sum())
    assert gate_kernels.score_noted(figures, noted, noted_n, layer, ids, 0.9) == before
    np.testing.assert_array_equal(figures[0], want_h)
    np.testing.assert_array_equal(figures[1], want_t)
    np.testing.assert_array_equal(figures[2], want_h / want_t)  # kept current in place
    np.testing.assert_array_equal(noted_n, want_n)


def test_noted_candidates_are_kept_by_layer_and_distance() -> None:
    """``gate_kernels.note_candidates`` keeps each candidate under its layer and distance, in order,
    and drops those beyond the gate's depth or the last layer."""
    L, D, E = 4, 2, 8
    noted = np.zeros((L, D, 2, E), dtype=np.int32)
    noted_n = np.zeros((L, D), dtype=np.int64)
    r = np.array([0, 0, 1, 2, 3], dtype=np.int64)  # rows of a plan from layer 0 (distance0 1)
    c = np.array([5, 2, 7, 1, 4], dtype=np.int64)
    rank = np.array([0, 1, 0, 0, 0], dtype=np.int64)
    gate_kernels.note_candidates(noted, noted_n, r, c, rank, 1, 1)
    assert noted_n.tolist() == [[0, 0], [2, 0], [0, 1], [0, 0]]  # distance 3 and 4 dropped
    assert noted[1, 0, :, :2].tolist() == [[5, 2], [0, 1]]
    assert noted[2, 1, :, :1].tolist() == [[7], [0]]


def test_idle_link_candidates_pay_when_used_more_often_than_their_victims() -> None:
    """On a link the demand copies keep busy (q = 1) no candidate pays; with idle link time for
    two copies the best two pay when their chance of use beats their victims' reuse."""
    rows = np.array([[0.5, 0.3, 0.2, 0.0]], dtype=np.float32)
    held_rows = np.zeros((1, 4), dtype=bool)
    prec = np.array([[0.8, 0.6, 0.4, 0.2]])  # by rank
    held = np.zeros(8, dtype=bool)
    args = (1e-3, 1.0, 1e-3, False, held, np.zeros(0), 0, 4, 8)
    none = (np.zeros(0, dtype=np.int64), np.zeros(3, dtype=np.int64))  # no sort of p_use
    assert not gate_kernels.gate_plan(rows, rows, held_rows, 1, prec, *args, 0.0, 1e-3, 0.0, *none)[3].any()
    keep, net = gate_kernels.gate_plan(rows, rows, held_rows, 1, prec, *args, 2.0, 1e-3, 0.0, *none)[3::2]
    np.testing.assert_array_equal(keep, [True, True, False])
    assert net == pytest.approx((0.8 + 0.6) * 1e-3)
    # each copy's host cost counts against it too: 0.7 ms leaves only the surest one
    keep, net = gate_kernels.gate_plan(rows, rows, held_rows, 1, prec, *args, 2.0, 1e-3, 7e-4, *none)[3::2]
    np.testing.assert_array_equal(keep, [True, False, False])
    assert net == pytest.approx(0.8e-3 - 7e-4)


@pytest.mark.parametrize("width", [1, 5, 8, 9, 64, 128, 129, 200, 384])
def test_row_probs_sum_in_numpys_order(width: int) -> None:
    rng = np.random.default_rng(width)
    for _ in range(50):
        x = ((rng.random((3, width)) ** 3) * rng.integers(1, 1000)).astype(np.float32)
        x[rng.random(x.shape) < 0.3] = 0
        x[0] = 0 if width % 2 else x[0]  # a zero row stays zero
        totals = x.sum(axis=1, keepdims=True, dtype=np.float32)
        totals[totals == 0] = 1.0
        np.testing.assert_array_equal(eam_kernels.row_probs(x), x / totals)


@pytest.mark.parametrize("seed", range(10))
def test_matched_row_probs_equals_einsum_of_the_matched_then_row_probs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, L, E = int(rng.integers(1, 20)), 6, 128
    entries = rng.random((n, L, E)).astype(np.float32)
    entries[rng.random(entries.shape) < 0.4] = 0
    entries.flags.writeable = False  # as EAMC.entries() hands it over
    times = rng.integers(0, 17, n) * (rng.random(n) < 0.6)  # many entries not matched
    lo = int(rng.integers(0, L))
    hi = int(rng.integers(lo + 1, L + 1))
    m = times.nonzero()[0]
    summed = np.einsum("m,mf->f", times[m].astype(np.float32), entries[m, lo:hi].reshape(len(m), -1))
    rows, matched = eam_kernels.matched_row_probs(entries, times, lo, hi)
    np.testing.assert_array_equal(rows, eam_kernels.row_probs(summed.reshape(hi - lo, E)))
    assert matched == bool(len(m))
    totals = summed.reshape(hi - lo, E).sum(axis=1, keepdims=True, dtype=np.float32)
    totals[totals == 0] = 1.0
    np.testing.assert_array_equal(rows, summed.reshape(hi - lo, E) / totals)


@pytest.mark.parametrize("seed", range(10))
def test_own_plus_eamc_equals_its_numpy_form(seed: int) -> None:
    rng = np.random.default_rng(seed)
    own, eamc = _ties(rng, (3, 16)), _ties(rng, (3, 16))
    own[0] = eamc[0] = 0  # a row without evidence
    for block, total in ((eamc, own + eamc), (own[:0], own)):
        final, evidence = eam_kernels.own_plus_eamc(own, block)
        np.testing.assert_array_equal(final, eam_kernels.row_probs(total))
        np.testing.assert_array_equal(evidence, total.any(axis=1))
    # row by row: the step's rows computed once (EAMPrefetch._own_rows) equal any window's
    whole, part = eam_kernels.own_plus_eamc(own, own[:0]), eam_kernels.own_plus_eamc(own[1:3], own[:0])
    np.testing.assert_array_equal(whole[0][1:3], part[0])
    np.testing.assert_array_equal(whole[1][1:3], part[1])


@pytest.mark.parametrize("seed", range(10))
def test_blend_equals_its_numpy_form(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, d, E = 3, int(rng.integers(1, 4)), 16
    rows = _ties(rng, (n, E))
    ahead = (rng.random((d, E)) * 4).astype(np.float32)
    spec = eam_kernels.row_probs(ahead) * 2.0
    want = rows.copy()
    want[:d] = eam_kernels.row_probs(want[:d] + spec)
    np.testing.assert_array_equal(eam_kernels.blend(rows, ahead, 2.0), want)


def test_the_python_kernels_equal_the_compiled_ones() -> None:
    """Without numba (``moe_runtime.jit``) the kernels run as written: same results."""
    rng = np.random.default_rng(7)
    E = 16
    rows = _ties(rng, (2, E))
    scores = (rows * 0.9).astype(np.float32)
    held = rng.random(6 * E) < 0.3
    wide = _ties(rng, (2, 128))
    wide[0, 12:] = 0  # fewer than INSERTION_MAX positive
    args = (rows, scores, held[2 * E : 4 * E].reshape(2, E), 1, rng.random((2, E)), 0.5, 0.2, 0.3)
    args += (
        False,
        held,
        rng.random(6 * E),
        1,
        E,
        40,
        2.0,
        0.4,
        1e-3,
        np.zeros(6 * E, dtype=np.int32),
        _sort_now(),
    )
    for fn, a in (
        (gate_kernels.gate_plan, args),
        (best_free, (scores.reshape(-1), held[: 2 * E], 5)),
        (eam_kernels.limit_scores, (rows, 3, 0.0, np.array([0.9, 0.8]))),
        (gate_kernels.ranked_free, (wide, wide < 0.2)),  # both rankings: insertion, counting
        (eam_kernels.blend, (rows, rows[:1] + 0.5, 2.0)),
        (eam_kernels.matched_row_probs, (rows.reshape(2, 1, E), np.array([3, 0]), 0, 1)),
        (eam_kernels.own_plus_eamc, (rows, scores)),
        (eam_kernels.match_counts, (scores, 3)),
        (eam_kernels.row_probs, ((rng.random((2, 300)) * 9).astype(np.float32),)),
        (
            victim_kernels.least_used,  # the walk of p_use's sort (it sorts at once)
            (held, rng.random(6 * E).astype(np.float32), E, 2 * E, 7, np.zeros(6 * E, np.int32), _sort_now()),
        ),
    ):
        compiled, plain = fn(*a), fn.py_func(*a)
        for x, y in zip(compiled if isinstance(compiled, tuple) else (compiled,),
                        plain if isinstance(plain, tuple) else (plain,), strict=True):  # fmt: skip
            np.testing.assert_array_equal(x, y)


def test_the_python_replan_equals_the_compiled_one() -> None:
    from moe_runtime.io.transfer_queue import _replan

    rng = np.random.default_rng(3)
    state = [rng.random(32) < 0.3, rng.random(32), rng.permutation(32).astype(np.int64), np.zeros(32)]
    state.append(rng.random(32) < 0.1)
    keys = rng.choice(32, size=9, replace=False).astype(np.int64)
    prio = rng.choice([0.25, 0.5, 0.75], size=9)
    for replace in (False, True):
        a = [x.copy() for x in state]
        b = [x.copy() for x in state]
        n_prefetch = int(state[0].sum())
        got = _replan(*a, True, keys, prio, replace, 1.0, 100, n_prefetch)
        want = _replan.py_func(*b, True, keys, prio, replace, 1.0, 100, n_prefetch)
        assert got[:5] == want[:5]
        np.testing.assert_array_equal(got[5], want[5])
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
