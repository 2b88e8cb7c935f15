"""EAM helpers (MoE-Infinity §4.1): counting convention, attribution, normalisation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.eam import (
    RequestEAM,
    activation_probability,
    eam_from_choices,
    layer_counts,
    normalize_rows,
    prefix_query,
    row_sums,
)


def _choices(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    """(T, L, k) distinct top-k ids per token and layer."""
    return np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :k]


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 20),
    layers=st.integers(1, 5),
    experts=st.integers(2, 10),
    data=st.data(),
)
def test_row_sum_is_tokens_times_top_k(tokens: int, layers: int, experts: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, experts))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    eam = eam_from_choices(_choices(rng, tokens, layers, experts, k), experts)
    assert eam.shape == (layers, experts) and eam.dtype == np.int64
    assert (row_sums(eam) == tokens * k).all()
    assert (eam <= tokens).all()  # distinct choices: an expert counts a token at most once


def test_missing_choices_are_skipped() -> None:
    ids = np.array([[[0, 1], [-1, -1]], [[1, 2], [2, 3]]])  # token 0 not recorded at layer 1
    eam = eam_from_choices(ids, 4)
    assert row_sums(eam).tolist() == [4, 2]
    assert eam[1].tolist() == [0, 0, 1, 1]


def test_bad_ids_rejected() -> None:
    with pytest.raises(ValueError, match="expert ids"):
        eam_from_choices(np.array([[[0, 4]]]), 4)
    with pytest.raises(ValueError, match=r"\(T, L, k\)"):
        eam_from_choices(np.zeros((2, 2)), 4)


def test_layer_counts_attribute_tokens_to_their_sequence() -> None:
    seq = np.array([0, 0, 1, 2, 2, 2])
    experts = np.array([[0, 1], [0, 2], [3, 1], [1, 2], [1, 0], [3, 2]])
    counts = layer_counts(seq, experts, num_seqs=3, num_experts=4)
    assert counts.tolist() == [[2, 1, 1, 0], [0, 1, 0, 1], [1, 2, 2, 1]]
    assert (counts.sum(axis=1) == np.bincount(seq) * 2).all()


def test_normalize_rows_keeps_zero_rows_zero() -> None:
    x = np.array([[[3.0, 4.0], [0.0, 0.0]], [[1.0, 0.0], [2.0, 2.0]]])
    n = normalize_rows(x)
    assert n.dtype == np.float32 and n.shape == x.shape
    np.testing.assert_allclose(n[0, 0], [0.6, 0.8], rtol=1e-6)
    assert (n[0, 1] == 0).all()
    np.testing.assert_allclose(np.linalg.norm(n[1], axis=-1), 1.0, rtol=1e-6)
    assert x[0, 0, 0] == 3.0  # input untouched


def test_activation_probability_rows_sum_to_one() -> None:
    entries = np.array([[[1, 0, 0], [0, 0, 0]], [[1, 1, 0], [0, 0, 0]]], dtype=float)
    p = activation_probability(entries)
    np.testing.assert_allclose(p[0], [2 / 3, 1 / 3, 0], rtol=1e-6)
    assert (p[1] == 0).all()


def test_prefix_query_adds_only_routed_layers_of_this_step() -> None:
    so_far = np.ones((3, 2), dtype=np.int64)
    step = np.full((3, 2), 5, dtype=np.int64)
    q = prefix_query(so_far, step, upto_layer=0)
    assert q.tolist() == [[6, 6], [1, 1], [1, 1]]
    assert prefix_query(so_far, step, upto_layer=-1).tolist() == so_far.tolist()


def test_request_eam_keeps_prefill_and_decode_apart() -> None:
    r = RequestEAM.zeros(2, 3)
    r.add(np.array([[1, 1, 0], [0, 2, 0]]), prefill=True)
    r.add(np.array([[0, 0, 1], [1, 0, 0]]), prefill=False)
    assert r.prefill.sum() == 4 and r.decode.sum() == 2
    assert r.total().tolist() == [[1, 1, 1], [1, 2, 0]]
