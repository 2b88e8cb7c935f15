"""The ``eam-reuse`` cache's compiled parts: its victim and its use probabilities.

:class:`moe_runtime.buffer.policies.EAMReuseCachePolicy` calls these.

NOTE: why compiled. A victim is chosen for every demand miss and landed prefetch once the buffer
is full, on the I/O thread while it holds the buffer's lock, so the compute thread waits on it.
As numpy (the evictable mask's ``nonzero``, a gather, ``argmax``, plus a rescore of every slot
and a re-derivation of the use probabilities at the first victim after each routed layer) it
cost several microseconds per victim and tens per layer: on the bundled model at a 25% buffer
and 4 GB/s, about 40 victims a decode step, the trial's ``cache`` arm
(``moe_runtime.prefetch.trial.ModeTrial``) spent 0.3-0.4 ms of a 7-8 ms step more compute-thread
CPU than LRU, more than the copies it saved. Here a victim is one loop over the
slots that scores only the evictable ones, and the probabilities of a routed layer's row are
derived in the same call as the next victim (:func:`reuse_victim`'s ``pending_ids``); routed layers
that no victim followed wait, and are derived together in one call (:func:`add_rows_probs`) at the
next victim or once a whole pass of layers waits (a compiled call per decode layer on the compute
thread cost about 5 us with its caches cold: 40 us of a 6.5 ms decode step at batch 1 and a 50%
buffer, where no victim comes for many layers). The victim's calls keep the GIL: with
``nogil`` the I/O thread's CPU time per decode MoE layer in victims rose from about 27 to 50 us
(``tools/lean_cost.py`` at 5cbaa3d, 50% buffer, 32 GB/s, batch 4), a release and re-take per victim, and
the compute thread's MoE block did not get faster. The victims are those of the numpy form: ``pow`` is
libm's rather than numpy's vector one, which can differ in the last bit, and
``tools/sim_fingerprint.py`` found no simulator output changed (0 of 40 runs). Without numba the
same Python runs (``moe_runtime.jit``), with the same results.
"""

from __future__ import annotations

import math

import numpy as np

from moe_runtime.jit import njit


@njit(cache=True)
def reuse_victim(
    evictable: np.ndarray,
    slot_key: np.ndarray,
    p_use: np.ndarray,
    recency: np.ndarray,
    layer: int,
    num_layers: int,
    num_experts: int,
    counts: np.ndarray,
    pending_ids: np.ndarray,
) -> int:
    """The evictable slot whose expert's next use is expected furthest away, or -1 for none.

    Args:
        evictable: ``[S]`` bool, the slots that may be taken.
        slot_key: ``[S]`` int, each slot's expert key ``layer * E + expert``.
        p_use: ``[L * E]`` float64, the chance each expert is used in a step.
        recency: ``[S]`` float64, the tick of each slot's last fill or use.
        layer: the layer routed last (``0 .. L - 1``).
        counts: ``[L, E]`` float64, the batch's counts (:func:`add_row_probs`).
        pending_ids: ``[T, k]`` int64 ids of ``layer`` not yet counted, or :data:`NO_IDS`: when
            ``T > 0`` they are added to row ``layer`` of ``counts`` and ``p_use`` first (the
            routed layer's update deferred to the first victim after it, in the same call).

    The score is ``d + L (1 / max(p, 1e-3) - 1) - 1e-9 * recency`` with ``d = ((j - layer - 1)
    mod L) + 1`` layer runs to the key's layer ``j``; the highest wins, ties go to the lowest slot.
    """
    if pending_ids.shape[0] > 0:
        add_row_probs(counts, p_use, layer, pending_ids)
    best, best_score = -1, 0.0
    for s in range(evictable.shape[0]):
        if not evictable[s]:
            continue
        key = slot_key[s]
        dist = (key // num_experts - layer - 1) % num_layers + 1
        p = p_use[key]
        if p < 1e-3:
            p = 1e-3
        score = (dist + num_layers * (1.0 / p - 1.0)) - 1e-9 * recency[s]
        if best < 0 or score > best_score:
            best, best_score = s, score
    return best


@njit(cache=True)
def add_row_probs(counts: np.ndarray, p_use: np.ndarray, layer: int, topk_ids: np.ndarray) -> None:
    """``counts[layer, e] += 1`` for each id ``e`` in ``topk_ids [T, k]`` (int64, each in
    ``0 .. E - 1``), then :func:`reuse_probs` of that one row for ``T`` tokens and top-``k``: the
    cache's per-layer update in a decode step, one dispatch and no conversion on the host."""
    tokens, top_k = topk_ids.shape
    for t in range(tokens):
        for j in range(top_k):
            counts[layer, topk_ids[t, j]] += 1.0
    reuse_probs(counts, p_use, layer, layer + 1, top_k, tokens)


@njit(cache=True)
def add_rows_probs(counts: np.ndarray, p_use: np.ndarray, layers: np.ndarray, topk_ids: np.ndarray) -> None:
    """:func:`add_row_probs` for each of ``n`` routed layers in order: ``layers [n]`` (int64)
    and their ids ``topk_ids [n * T, k]`` (int64, layer ``i``'s ``[T, k]`` at rows ``i * T ..``;
    every layer of one step shape). A layer listed twice gets both updates; the result equals
    ``n`` calls of :func:`add_row_probs` (a row's probabilities depend only on its counts)."""
    n = layers.shape[0]
    tokens = topk_ids.shape[0] // n if n else 0
    for i in range(n):
        add_row_probs(counts, p_use, layers[i], topk_ids[i * tokens : (i + 1) * tokens])


@njit(cache=True)
def reuse_probs(counts: np.ndarray, p_use: np.ndarray, lo: int, hi: int, top_k: int, tokens: int) -> None:
    """Rows ``lo .. hi - 1`` of ``p_use [L * E]`` from ``counts [L, E]`` (float64, integer-valued):
    ``p = 1 - (1 - min(1, k * c / n))^T``, the chance a step of ``T = tokens`` tokens uses the
    expert when its share of the ``n`` routed tokens so far (``c / n`` of the choices, each token
    making ``k = top_k``) holds (MoE-Infinity §4's request EAM as a use probability); a row without
    tokens is 0. The power is libm's ``pow`` (``x`` itself for ``T = 1``, ``x * x`` for ``T = 2``),
    so the compiled and the plain form agree bit for bit."""
    num_experts = counts.shape[1]
    for layer in range(lo, hi):
        total = 0.0
        for e in range(num_experts):
            total += counts[layer, e]  # integer-valued: exact in any order
        div = total if total > 0 else 1.0
        for e in range(num_experts):
            share = counts[layer, e] / div * top_k
            q = 1.0 - (share if share < 1.0 else 1.0)
            if tokens == 1:
                v = q
            elif tokens == 2:
                v = q * q
            else:
                v = math.pow(q, float(tokens))
            p_use[layer * num_experts + e] = 1.0 - v


#: ``pending_ids`` of :func:`reuse_victim` when no routed layer waits.
NO_IDS = np.zeros((0, 1), dtype=np.int64)

_warm = False


def warm() -> None:
    """Compile (or load from numba's on-disk cache) :func:`reuse_victim` for the types the cache
    passes, once per process, so its first victim does not pay the compile on the I/O thread."""
    global _warm
    if not _warm:
        counts = np.zeros((1, 1))
        reuse_probs(counts, np.zeros(1), 0, 1, 1, 3)
        add_row_probs(counts, np.zeros(1), 0, np.zeros((1, 1), dtype=np.int64))
        add_rows_probs(counts, np.zeros(1), np.zeros(1, dtype=np.int64), np.zeros((1, 1), dtype=np.int64))
        one, key = np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.int64)
        for pending in (NO_IDS, np.zeros((1, 1), dtype=np.int64)):
            reuse_victim(one, key, np.ones(1), np.zeros(1), 0, 1, 1, counts, pending)
        _warm = True
