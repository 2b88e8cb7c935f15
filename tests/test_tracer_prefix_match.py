"""PrefixMatcher: incremental per-layer matching equals a full EAMC search on the same queries."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.eam import normalize_rows
from tracer.eamc import EAMC
from tracer.prefix_match import PrefixMatcher
from tracer.synth import synthetic_eams

L, E = 5, 8


def _check_same(eamc: EAMC, queries: np.ndarray, sims: np.ndarray, idx: np.ndarray, k: int) -> None:
    want_sims, _ = eamc.search(queries, k=k)
    np.testing.assert_allclose(sims, want_sims, rtol=1e-5, atol=1e-5)
    # the returned slots really score what is reported (ties may pick other slots)
    again = np.einsum("ble,bkle->bk", _norm(queries), eamc.entries()[idx])
    np.testing.assert_allclose(again, sims, rtol=1e-5, atol=1e-5)


def _norm(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x, dtype=np.float64), where=n > 0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60), batch=st.integers(1, 5), k=st.integers(1, 6), seed=st.integers(0, 1000))
def test_updates_equal_full_searches(n: int, batch: int, k: int, seed: int) -> None:
    eamc = EAMC(L, E, capacity=64)
    for eam in synthetic_eams(n, L, E, tokens=(2, 30), groups=6, seed=seed):
        eamc.add(eam)
    rng = np.random.default_rng(seed)
    so_far = synthetic_eams(batch, L, E, tokens=(0, 20), groups=6, seed=seed, request_seed=5).astype(
        np.float32
    )
    if seed % 2:
        so_far[:] = 0  # a first step: nothing seen yet
    m = PrefixMatcher(eamc, k=k)
    m.begin_step(so_far)
    query = so_far.copy()
    for layer in range(L):
        query[:, layer] += rng.integers(0, 3, size=(batch, E))
        sims, idx = m.update(layer, query)
        assert sims.shape == (batch, min(k, n))
        if query[:, : layer + 1].any():
            _check_same(eamc, query, sims, idx, k)
        if layer == 2:  # the EAMC changes mid-step: the matcher notices and rebuilds
            eamc.add(np.ones((L, E)))
            n = len(eamc)


def test_bad_shapes() -> None:
    eamc = EAMC(L, E)
    m = PrefixMatcher(eamc)
    with pytest.raises(ValueError, match="so_far"):
        m.begin_step(np.zeros((2, L, E + 1)))
    m.begin_step(np.zeros((2, L, E)))
    with pytest.raises(ValueError, match="query row"):
        m.update(0, np.zeros((3, E)))
    assert m.update(0, np.ones((2, E)))[0].shape == (2, 0)  # empty collection


def _collection_and_queries(
    width: int, seed: int, entries: int, batch: int, tokens: tuple[int, int], request_seed: int
) -> tuple[EAMC, np.ndarray]:
    """An EAMC of ``entries`` synthetic request EAMs and ``batch`` float32 queries ``(B, L, width)``
    drawn from the same task groups."""
    eamc = EAMC(L, width, capacity=64)
    for eam in synthetic_eams(entries, L, width, tokens=(2, 30), groups=6, seed=seed):
        eamc.add(eam)
    query = synthetic_eams(batch, L, width, tokens=tokens, groups=6, seed=seed, request_seed=request_seed)
    return eamc, query.astype(np.float32)


@pytest.mark.parametrize("width", [8, 12, 16, 60, 128])  # faiss's own _ny kernels, then the one-call form
@pytest.mark.parametrize("seed", range(3))
def test_update_rows_sums_equal_updates_bit_for_bit(width: int, seed: int) -> None:
    """Fed the changed rows only, the running sums are those of :meth:`update` on full queries
    (bit for bit, so the same top k), also across an EAMC change mid-step; and the one-call
    cosines of a layer equal one ``fvec_inner_products_ny`` per query."""
    batch = 5
    eamc, query = _collection_and_queries(width, seed, 40, batch, (0, 20), request_seed=5)
    rng = np.random.default_rng(seed)
    query[1] = 0  # a query with nothing seen yet
    full, rows = PrefixMatcher(eamc, k=4), PrefixMatcher(eamc, k=4)
    full.begin_step(query)
    rows.begin_step(query)
    for layers in ([0], [1, 2], [4]):  # layer 3 not routed (skipped)
        for layer in layers:
            query[:, layer] += rng.integers(0, 3, size=(batch, width))
        full.update(layers, query)
        rows.update_rows(layers, query[:, layers])
        np.testing.assert_array_equal(rows.scores, full.scores)
        if layers == [1, 2]:
            eamc.add(np.ones((L, width)))
    q = normalize_rows(query[:, 2])
    slab = eamc.layer_major()[2]
    want = np.empty((batch, len(eamc)), np.float32)
    for b in range(batch):
        faiss.fvec_inner_products_ny(
            faiss.swig_ptr(want[b]), faiss.swig_ptr(q[b]), faiss.swig_ptr(slab), width, len(eamc)
        )
    np.testing.assert_array_equal(rows._cos[2], want)


@pytest.mark.parametrize("width", [8, 16])  # faiss's own _ny kernel, and the one-call form
@pytest.mark.parametrize("eamc_changes", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_resume_step_equals_a_fresh_begin_bit_for_bit(width: int, eamc_changes: bool, seed: int) -> None:
    """A step started from the last one's rows (``resume_step`` on the rows that changed, then the
    current row updated) holds the state ``begin_step`` on the full queries makes, bit for bit,
    also when the EAMC changed in between (the whole table is rebuilt then)."""
    batch = 3
    eamc, query = _collection_and_queries(width, seed, 30, batch, (1, 20), request_seed=3)
    rng = np.random.default_rng(seed)
    m = PrefixMatcher(eamc, k=4)
    m.begin_step(query)
    fed = [0, 1, 3]  # rows taken in after their layer routed in the last step (2 and 4 were not)
    for layer in fed:
        query[:, layer] += rng.integers(0, 3, size=(batch, width))
        m.update_rows([layer], query[:, layer : layer + 1])
    query[:, [2, 4]] += rng.integers(0, 3, size=(batch, 2, width))  # routed, not taken in
    if eamc_changes:
        eamc.add(np.ones((L, width)))
    layer = 1  # the next step's first match: rows 0 and 1 routed again
    query[:, : layer + 1] += rng.integers(0, 3, size=(batch, layer + 1, width))
    stale = [2, 4]
    rows = sorted({*stale, *range(layer + 1)})
    m.resume_step(rows, query[:, rows])
    m.update_rows([layer], query[:, layer : layer + 1])
    fresh = PrefixMatcher(eamc, k=4)
    fresh.begin_step(query)
    fresh.update_rows([layer], query[:, layer : layer + 1])
    np.testing.assert_array_equal(m.scores, fresh.scores)
    np.testing.assert_array_equal(m._cos, fresh._cos)
    with pytest.raises(ValueError, match="rows must be"):
        m.resume_step([0], query[:, :2])
