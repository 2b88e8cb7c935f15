"""The ``eam`` policy's planning reads only what changed since its last plan (the recorder's
``query_rows``, ``PrefixMatcher.update_rows`` with ``kernels.match_counts``, the small search's
normalised query kept per step, the own term from ``query_sum``): its matches and plans are
exactly those of the from-scratch computation, the full ``[B, L, E]`` query every planning layer."""

from __future__ import annotations

import hashlib

import faiss
import numpy as np
import pytest

import moe_runtime.prefetch.eam as eam
import moe_runtime.prefetch.eam_kernels as kernels
from moe_runtime.prefetch.gate import PrefetchGate
from moe_runtime.prefetch.term_value import TermValue
from tests.test_sim_engine import random_requests, sim_for
from tracer import prefix_match
from tracer.prefix_match import PrefixMatcher
from tracer.recorder import RequestRecorder


def faiss_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]`` ids of each row's top ``k``: faiss's min-heap, as ``PrefixMatcher`` took it."""
    batch, n = scores.shape
    k = min(k, n)
    sims, idx = np.full((batch, k), -np.inf, np.float32), np.zeros((batch, k), np.int64)
    heap = faiss.float_minheap_array_t()
    heap.nh, heap.k = batch, k
    heap.val, heap.ids = faiss.swig_ptr(sims), faiss.swig_ptr(idx)
    heap.addn(n, faiss.swig_ptr(np.ascontiguousarray(scores, dtype=np.float32)))
    heap.reorder()
    return idx


def _everything(_: int) -> bool:
    return True


class _AllWidths:
    """Stands in for ``prefix_match._NY_KERNELS``: every width takes one ``_ny`` call per query."""

    __contains__ = staticmethod(_everything)


def _from_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Answer the new reads with the old computations: the full query, summed or sliced; faiss's
    heap for the top k; one ``fvec_inner_products_ny`` per query."""
    weighted = RequestRecorder.query_sum  # the cache's prompt-weighted read has no older form

    def query_sum(self, ids, upto, prefill_weight=1.0):
        if prefill_weight != 1.0:
            return weighted(self, ids, upto, prefill_weight)
        return self.query(ids, upto).sum(axis=0)

    monkeypatch.setattr(RequestRecorder, "query_sum", query_sum)
    monkeypatch.setattr(
        RequestRecorder, "query_rows", lambda self, ids, lo, hi: self.query(ids, hi - 1)[:, lo:hi].copy()
    )
    monkeypatch.setattr(
        kernels,
        "match_counts",
        lambda scores, k: np.bincount(faiss_top_k(scores, k).ravel(), minlength=scores.shape[1]),
    )
    monkeypatch.setattr(prefix_match, "_NY_KERNELS", _AllWidths())

    def own_rows(self):  # the own term's rows recomputed at every use, not kept for the step
        final, evidence = kernels.own_plus_eamc(self._own, self._own[:0])
        return final, evidence.tolist()

    monkeypatch.setattr(eam.EAMPrefetch, "_own_rows", own_rows)


class _EveryThirdPlan(TermValue):
    """The EAMC term weighed as the runtime does, but computed at every third plan only (the
    simulator weighs nothing: its host time is 0), so the matcher must catch up on skipped rows."""

    def wanted(self, block_s: float) -> bool:
        self._since += 1
        return self._since % 3 == 1


def _plans(
    monkeypatch: pytest.MonkeyPatch, experts: int, seed: int, skip: bool = False
) -> tuple[str, dict, int]:
    """Hash of every prediction and every issued plan of a simulated run, its counters, and how
    many planning layers matched against the EAMC; each match is checked against the full query
    (one ``EAMC.search``, or a ``PrefixMatcher`` fed full queries) as it is made. ``skip``: the
    EAMC term is left out of two plans in three (:class:`_EveryThirdPlan`)."""
    reqs = random_requests(seed, 40, 6, experts, 2, 6)  # more finished requests than matches (16)
    sim = sim_for(layers=6, experts=experts, slots=2 * experts, batch=3)
    digest = hashlib.sha256()
    matched = [0]
    refs: dict[int, PrefixMatcher] = {}
    predict_rows, match, issue = eam.EAMPrefetch._predict_rows, eam.EAMPrefetch._match, eam.EAMPrefetch.issue

    def logged_predict(self, layer, request_ids, eamc=True):
        assert eamc or skip  # the simulator never leaves the EAMC term out (term_value)
        rows = predict_rows(self, layer, request_ids, eamc)
        digest.update(b"-" if rows is None else rows.tobytes())
        return rows

    steps: dict[int, tuple] = {}

    def checked_match(self, layer, request_ids, k):
        fresh = self._match_ids is None or self._matcher is None or self._matcher.k != k
        # a step's first match: the reference starts from the full query (the policy may resume
        # its matcher from the last step instead, and must land on the same state)
        step = (self.recorder.epoch, tuple(request_ids))
        fresh = fresh or steps.get(id(self)) != step
        steps[id(self)] = step
        layers = [*self._unmatched, layer]
        got = match(self, layer, request_ids, k)
        query = self.recorder.query(request_ids, layer)  # [B, L, E], from scratch
        n = len(self.eamc)
        if self._match_ids is None:  # the small search
            want = np.bincount(self.eamc.search(query, k=k)[1].ravel(), minlength=n)
        else:
            if fresh:
                refs[id(self)] = PrefixMatcher(self.eamc, k=k)
                refs[id(self)].begin_step(query)
                layers = [layer]
            want = np.bincount(refs[id(self)].update(layers, query)[1].ravel(), minlength=n)
        np.testing.assert_array_equal(got, want)
        matched[0] += 1
        return got

    def logged_issue(self, scores, first_layer=0, **kwargs):
        digest.update(np.ascontiguousarray(scores).tobytes() + bytes([first_layer]))
        return issue(self, scores, first_layer=first_layer, **kwargs)

    init = eam.EAMPrefetch.__init__

    def init_skipping(self, *args, **kwargs):
        init(self, *args, **kwargs)
        assert self.eamc_term is None  # the simulator's clock: nothing weighed
        self.eamc_term = _EveryThirdPlan()

    with monkeypatch.context() as m:
        if skip:
            m.setattr(eam.EAMPrefetch, "__init__", init_skipping)
        m.setattr(eam.EAMPrefetch, "_predict_rows", logged_predict)
        m.setattr(eam.EAMPrefetch, "_match", checked_match)
        m.setattr(eam.EAMPrefetch, "issue", logged_issue)
        run = sim.run("eam", "eam-reuse", reqs[:24], reqs[24:])
    return digest.hexdigest(), dict(run.stats), matched[0]


@pytest.mark.parametrize(
    ("experts", "seed", "skip"),
    # faiss's own 8-wide kernel, and the one-call form; with the EAMC term skipped at some plans
    [(e, s, False) for e in (8, 16) for s in range(4)] + [(e, s, True) for e in (8, 16) for s in range(2)],
)
def test_plans_equal_the_from_scratch_computation(
    experts: int, seed: int, skip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the gate issues every candidate, so that the plans themselves reach the buffer and are compared
    init = PrefetchGate.__init__

    def open_gate(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.force_open = True

    monkeypatch.setattr(PrefetchGate, "__init__", open_gate)
    new = _plans(monkeypatch, experts, seed, skip)
    _from_scratch(monkeypatch)
    old = _plans(monkeypatch, experts, seed, skip)
    assert new == old
    assert new[2] > 20 and new[1]["prefetch_issued"] > 0  # the runs matched and prefetched


@pytest.mark.parametrize("seed", range(4))
def test_match_counts_are_faiss_heaps_top_k(seed: int) -> None:
    """Ties included (few distinct scores): the same entries as faiss's heap picks, compiled or
    as plain Python."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        batch, n, k = int(rng.integers(1, 6)), int(rng.integers(1, 60)), int(rng.integers(1, 20))
        levels = int(rng.integers(1, 5))
        scores = (rng.integers(0, levels, (batch, n)) / 3).astype(np.float32)
        if seed % 2:
            scores += rng.random((batch, n), dtype=np.float32)
        want = np.bincount(faiss_top_k(scores, k).ravel(), minlength=n)
        np.testing.assert_array_equal(kernels.match_counts(scores, k), want)
        np.testing.assert_array_equal(kernels.match_counts.py_func(scores, k), want)
