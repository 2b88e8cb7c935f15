"""EAMC (MoE-Infinity §4.2): capacity, replacement, matching, prefix matching, IVF."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.eam import normalize_rows
from tracer.eamc import EAMC
from tracer.synth import synthetic_eams

L, E = 4, 8


def _eams(n: int, seed: int = 0) -> np.ndarray:
    return synthetic_eams(n, L, E, tokens=(4, 40), groups=8, seed=seed)


@settings(max_examples=30, deadline=None)
@given(capacity=st.integers(1, 12), n=st.integers(0, 40), seed=st.integers(0, 1000))
def test_capacity_never_exceeded(capacity: int, n: int, seed: int) -> None:
    eamc = EAMC(L, E, capacity=capacity)
    for i, eam in enumerate(_eams(n, seed)):
        slot = eamc.add(eam)
        assert 0 <= slot < capacity
        assert len(eamc) == min(i + 1, capacity) <= eamc.capacity
    assert eamc.entries().shape == (min(n, capacity), L, E)


def test_replacement_evicts_the_most_similar_entry() -> None:
    eamc = EAMC(L, E, capacity=5)
    stored = _eams(5, seed=1)
    for eam in stored:
        eamc.add(eam)
    new = _eams(1, seed=2)[0]
    flat = normalize_rows(stored).reshape(5, -1)
    expected = int(np.argmax(flat @ normalize_rows(new).reshape(-1)))
    before = eamc.entries().copy()
    assert eamc.add(new) == expected
    after = eamc.entries()
    np.testing.assert_array_equal(after[expected], normalize_rows(new))
    keep = [i for i in range(5) if i != expected]
    np.testing.assert_array_equal(after[keep], before[keep])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000))
def test_query_equal_to_entry_scores_one_per_seen_layer(seed: int) -> None:
    eams = _eams(20, seed)
    eamc = EAMC(L, E, capacity=20)
    for eam in eams:
        eamc.add(eam)
    target = int(np.random.default_rng(seed).integers(20))
    sims, idx = eamc.search(eams[target].astype(np.float32), k=1)
    # ties with an identical stored entry are possible in principle; the score is what matters
    np.testing.assert_allclose(sims[0, 0], L, rtol=1e-5)
    assert np.allclose(eamc.entries()[idx[0, 0]], eamc.entries()[target])


def test_entry_rows_are_normalised() -> None:
    eamc = EAMC(L, E, capacity=4)
    for eam in _eams(4):
        eamc.add(eam)
    np.testing.assert_allclose(np.linalg.norm(eamc.entries(), axis=-1), 1.0, rtol=1e-5)
    with pytest.raises(ValueError):
        eamc.entries()[0, 0, 0] = 1.0  # read-only view


def test_prefix_matching_ignores_unseen_layers() -> None:
    eamc = EAMC(L, E, capacity=2)
    a = np.zeros((L, E), dtype=np.int64)
    a[:, 0] = 5
    b = a.copy()
    b[2:] = 0
    b[2:, 7] = 5  # agrees with a on layers 0-1 only
    eamc.add(a)
    eamc.add(b)
    q = b.astype(np.float32)
    q[2:] = 0  # only layers 0 and 1 seen so far
    sims, idx = eamc.search(q, k=2)
    np.testing.assert_allclose(sims[0], [2.0, 2.0], rtol=1e-6)  # a and b tie: unseen rows ignored
    assert sorted(idx[0].tolist()) == [0, 1]
    full = b.astype(np.float32)
    sims, idx = eamc.search(full, k=2)
    assert idx[0, 0] == 1 and sims[0, 0] == pytest.approx(4.0, rel=1e-6)
    assert sims[0, 1] == pytest.approx(2.0, rel=1e-6)


def test_batch_search_equals_single_searches_and_prefix_query_helper() -> None:
    eamc = EAMC(L, E, capacity=50)
    for eam in _eams(50):
        eamc.add(eam)
    queries = _eams(8, seed=9).astype(np.float32)
    queries[:, 3:] = 0
    sims, idx = eamc.search(queries, k=3)
    assert sims.shape == idx.shape == (8, 3)
    for b in range(8):
        s1, i1 = eamc.search(queries[b], k=3)
        np.testing.assert_allclose(s1[0], sims[b], rtol=1e-6)
    assert (np.diff(sims, axis=1) <= 1e-6).all()  # best first
    q = EAMC.prefix_query(np.zeros((L, E)), queries[0], upto_layer=2)
    np.testing.assert_array_equal(q, queries[0])


def test_fewer_entries_than_k_and_empty() -> None:
    eamc = EAMC(L, E, capacity=10)
    sims, idx = eamc.search(np.ones((2, L, E)), k=4)
    assert sims.shape == (2, 0)
    eamc.add(np.ones((L, E)))
    sims, idx = eamc.search(np.ones((2, L, E)), k=4)
    assert idx.tolist() == [[0], [0]]
    assert eamc.query_stats.num_queries == 2 and eamc.query_stats.num_vectors == 4


def test_bad_shapes_rejected() -> None:
    eamc = EAMC(L, E)
    with pytest.raises(ValueError, match="EAM must be"):
        eamc.add(np.ones((L + 1, E)))
    with pytest.raises(ValueError, match="queries must be"):
        eamc.search(np.ones((1, L, E + 1)))
    with pytest.raises(ValueError):
        EAMC(L, E, capacity=0)
    with pytest.raises(ValueError):
        EAMC(L, E, index="hnsw")


def test_ivf_index_trains_then_tracks_replacements() -> None:
    eamc = EAMC(L, E, capacity=300, index="ivf", nlist=8, nprobe=8)
    eams = _eams(400, seed=3)
    for eam in eams[:300]:
        eamc.add(eam)
    assert eamc._ivf is not None and eamc._ivf.trained
    queries = eams[300:].astype(np.float32)
    exact = normalize_rows(queries).reshape(100, -1) @ eamc.entries().reshape(300, -1).T
    _, idx = eamc.search(queries, k=1)
    # nprobe == nlist scans every cell: exact up to ties
    np.testing.assert_allclose(exact[np.arange(100), idx[:, 0]], exact.max(axis=1), rtol=1e-5)
    slot = eamc.add(eams[0] * 3)  # same pattern as entry 0 -> overwrites entry 0 in the index too
    assert slot == 0
    sims, idx = eamc.search(eams[0].astype(np.float32), k=1)
    assert idx[0, 0] == 0 and sims[0, 0] == pytest.approx(L, rel=1e-5)


def test_layer_major_copy_follows_adds_and_replacements() -> None:
    eamc = EAMC(L, E, capacity=6)
    eams = _eams(12, seed=4)
    for eam in eams[:3]:
        eamc.add(eam)
    eamc.layer_major()  # made now, then kept in step by add
    for eam in eams[3:]:
        eamc.add(eam)
    np.testing.assert_array_equal(eamc.layer_major(), eamc.entries().transpose(1, 0, 2))
