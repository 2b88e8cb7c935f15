"""The EAMC term of an ``eam`` plan is weighed online (``moe_runtime.prefetch.term_value``): its
measured gain in used candidates against its host time; skipped, it is probed at doubling
intervals, and the simulator never skips it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_runtime.prefetch.eam_kernels as eam_kernels
import moe_runtime.prefetch.term_kernels as term_kernels
from moe_runtime.prefetch.term_value import MAX_BACKOFF, MIN_SCORED, TermValue
from tests.test_sim_engine import sim_for


def _candidates(row: np.ndarray, held: np.ndarray, cap: int) -> np.ndarray:
    """The definition: the ``cap`` largest positive entries (ties: lower id first), less the
    held, as ascending ids."""
    order = np.argsort(-row, kind="stable")[:cap]
    order = order[row[order] > 0]
    return np.sort(order[~held[order]])


def test_candidates_are_the_best_cap_experts_the_buffer_does_not_hold() -> None:
    row = np.array([0.1, 0.4, 0.0, 0.4, 0.2, 0.05], dtype=np.float32)
    held = np.zeros(6, dtype=bool)
    top = term_kernels.top_candidates
    np.testing.assert_array_equal(top(row, held, 3), [1, 3, 4])
    np.testing.assert_array_equal(top(row, held, 2), [1, 3])  # ties at the cap: lower id first
    held[3] = True
    np.testing.assert_array_equal(top(row, held, 3), [1, 4])  # held: a prefetch copies nothing
    np.testing.assert_array_equal(top(row, held, 2), [1])  # a held expert still takes its place
    np.testing.assert_array_equal(top(row, held, 6), [0, 1, 4, 5])  # zeros are no candidates
    np.testing.assert_array_equal(top(row, held, 9), [0, 1, 4, 5])  # cap beyond E
    assert top(row, held, 0).size == 0


@pytest.mark.parametrize("seed", range(6))
def test_term_candidates_are_both_plans_next_layer_candidates(seed: int) -> None:
    """``term_kernels.term_candidates`` equals the definition on row 0 of each plan, the router
    lookahead blended in as ``eam_kernels.blend`` blends it, on rows with ties, zeros and held experts."""
    rng = np.random.default_rng(seed)
    E, D = 32, 1 + seed % 3
    rows = [rng.choice([0.0, 0.25, 0.5, 1.0, 2.0], size=(D, E)).astype(np.float32) for _ in range(2)]
    held = rng.random(E) < 0.3
    for d in (0, 1, D):
        ahead = rng.random((d, E)).astype(np.float32)
        for cap in (0, 1, 3, 8, E):
            got = term_kernels.term_candidates(rows[0], rows[1], ahead, 0.7, held, cap)
            for ids, plan in zip(got, rows, strict=True):
                row = eam_kernels.blend(plan, ahead, 0.7)[0] if d else plan[0]
                assert ids.dtype == np.int64
                np.testing.assert_array_equal(ids, _candidates(row, held, cap))


def test_the_gain_is_the_running_difference_in_used_candidates() -> None:
    term = TermValue(decay=0.5)
    term.note(3, np.array([1, 2, 7]), np.array([2, 4, 5]))
    term.observe(2, np.array([[1, 2]]))  # nothing noted for layer 2
    assert term.scored == 0
    term.observe(3, np.array([[1, 2], [7, 0]]))  # with: 1, 2, 7 used; without: 2 only
    assert term.scored == 1 and term.gain_hits == 2.0
    term.note(4, np.array([1]), np.array([3]))
    term.observe(4, np.array([[3, 0]]))  # only the plan without the term was right
    assert term.gain_hits == 0.5 * 2.0 + 0.5 * -1.0
    term.note(5, np.array([1]), np.array([3]))
    term.new_step()  # a step's unchecked candidates are dropped
    term.observe(5, np.array([[1, 0]]))
    assert term.scored == 2


def _pattern(term: TermValue, plans: int, block_s: float) -> list[int]:
    """Indices of the plans among the next ``plans`` that compute the term."""
    return [i for i in range(plans) if term.wanted(block_s)]


def test_a_term_that_does_not_pay_is_probed_at_doubling_intervals_and_one_that_pays_runs() -> None:
    term = TermValue(probe_every=2)
    assert _pattern(term, MIN_SCORED, 1e-3) == list(range(MIN_SCORED))  # too few scored to tell
    term.scored, term.gain_hits, term.host_s = MIN_SCORED, 0.1, 1e-4
    probes = _pattern(term, 200, 1e-4)  # gain 0.1 x 0.1 ms = 10 us < its 100 us: probes only
    gaps = np.diff([-1, *probes]).tolist()
    cap = 2 << MAX_BACKOFF
    assert gaps[:6] == [2, 4, 8, 16, 32, cap] and set(gaps[5:]) == {cap}
    assert term.skipped == 200 - len(probes) and term.used == MIN_SCORED + len(probes)
    assert _pattern(term, 5, 2e-3) == list(range(5))  # 0.1 x 2 ms = 200 us > 100 us: it pays
    term.gain_hits = 0.0  # no longer: the probes start again from probe_every
    assert np.diff([-1, *_pattern(term, 8, 2e-3)]).tolist() == [2, 4]


def test_its_host_time_is_a_clipped_running_mean() -> None:
    term = TermValue(decay=0.5)
    term.note_host_time(1e-4)
    assert term.host_s == 1e-4
    term.note_host_time(1.0)  # a cold or preempted sample counts at most 4 times the mean
    assert term.host_s == pytest.approx(0.5 * 1e-4 + 0.5 * 4e-4)


@pytest.mark.parametrize(("probe_every", "decay"), [(0, 0.5), (2, 1.0), (2, -0.1)])
def test_bad_settings_are_refused(probe_every: int, decay: float) -> None:
    with pytest.raises(ValueError):
        TermValue(probe_every=probe_every, decay=decay)


def test_the_simulator_never_weighs_the_term() -> None:
    state = sim_for(layers=3, experts=6, slots=6, batch=2).make_state("eam", "lru")
    assert state.prefetcher.eamc_term is None  # host time is 0 on its clock: the term is always in


def test_the_runtime_leaves_out_an_eamc_term_that_adds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_policies import FakeEAMC, FakeRecorder, small_store

    import moe_runtime.prefetch.eam as eam
    from moe_runtime.buffer import ExpertBuffer
    from moe_runtime.prefetch import make_prefetch_policy

    matched = [0]
    match = eam.EAMPrefetch._match
    monkeypatch.setattr(
        eam.EAMPrefetch, "_match", lambda *a: (matched.__setitem__(0, matched[0] + 1), match(*a))[1]
    )
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        # the EAMC holds the batch's own EAM (twice, so the best match is searched for):
        # matching it predicts what the own term does
        eye = np.eye(4, 5)
        pol = make_prefetch_policy(
            "eam", buffer=buf, num_layers=4, num_experts=5, top_k=2, recorder=FakeRecorder(eye),
            eamc=FakeEAMC(np.stack([eye, eye])), lookahead=1, probe_every=2, matches=1,
        )  # fmt: skip
        assert pol.eamc_term is not None and pol.trial is not None
        pol.trial = None  # plans at every layer: the arm stays prefetching
        pol.gate.force_open = True
        for layer in range(4):  # a prompt of 3 tokens: prefill plans always match, unweighed
            pol.after_routing(layer, ["a"], np.array([[0, 1], [2, 3], [1, 4]]))
        pol.end_step()
        assert matched[0] == 3 and pol.eamc_term.used == pol.eamc_term.skipped == 0
        assert pol.eamc_term.host_s == 0.0
        matched[0] = 0
        ids = np.array([[0, 1]])
        for _ in range(40):
            for layer in range(4):
                pol.after_routing(layer, ["a"], ids)
            pol.end_step()
        term = pol.eamc_term
        assert term.scored >= MIN_SCORED and term.gain_hits == 0.0 and term.host_s > 0
        assert term.skipped > term.used > MIN_SCORED  # probed only, after the first scored plans
        assert matched[0] == term.used  # a skipped plan matches nothing
        # a plan without the term is the own term's alone: layer 1's own row is expert 1
        pol._last = None
        pol._plan(0, ["a"], ids)
        np.testing.assert_array_equal(pol._last[1][0] > 0, np.eye(4, 5)[1] > 0)
    finally:
        buf.close()


@pytest.mark.parametrize("seed", range(4))
def test_used_difference_counts_as_the_masks_do(seed: int) -> None:
    """The compiled difference in used candidates equals the numpy reference: a mask of the
    routed ids (negative ids: none), candidates past the largest routed id unused."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, 20, size=12).astype(np.int64)
    with_term = rng.choice(30, size=7, replace=False).astype(np.int64)
    without_term = rng.choice(30, size=5, replace=False).astype(np.int64)
    used = np.zeros(max(int(ids.max()) + 1, 1), dtype=bool)
    used[ids[ids >= 0]] = True

    def hits(experts: np.ndarray) -> int:
        return int(used[experts[experts < used.size]].sum())

    want = hits(with_term) - hits(without_term)
    for fn in (term_kernels.used_difference, getattr(term_kernels.used_difference, "py_func", None)):
        if fn is not None:
            assert fn(ids, with_term, without_term) == want
