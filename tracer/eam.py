"""Expert Activation Matrices (MoE-Infinity §4.1).

An EAM of a model with ``L`` MoE layers and ``E`` experts per layer is an ``(L, E)`` int64 matrix
``M`` where ``M[l, e]`` is the number of tokens routed to expert ``e`` of MoE layer ``l``.

Counting convention (used everywhere in the tracer): every one of a token's ``k`` top-k choices
counts once, so a row of an EAM built from ``n`` tokens sums to ``n * k`` (the paper's top-1
definition ``sum_j M[i][j] = n`` is the ``k = 1`` case). A choice recorded as ``-1`` (not
recorded, e.g. a gap in an imported log) counts nowhere.

* **Iteration EAM** -- the tokens of one sequence in one forward step.
* **Request EAM** -- the iteration EAMs of a request summed, prefill and decode kept apart
  (:class:`RequestEAM`).

Matching (§4.2) compares EAMs row by row: :func:`normalize_rows` L2-normalises each row (zero rows
stay zero), so the inner product of two normalised EAMs is the sum of per-layer cosines.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

EAM_DTYPE = np.int64


def empty_eam(num_layers: int, num_experts: int) -> np.ndarray:
    """A zero ``(num_layers, num_experts)`` int64 EAM."""
    return np.zeros((num_layers, num_experts), dtype=EAM_DTYPE)


def eam_from_choices(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Build an EAM from per-token top-k choices.

    Args:
        ids: ``(T, L, k)`` integer expert ids per token, MoE layer and choice; ``-1`` = not
            recorded (skipped).
        num_experts: ``E``.

    Returns:
        ``(L, E)`` int64; row ``l`` sums to the number of recorded choices at layer ``l``
        (``T * k`` when nothing is missing).

    Raises:
        ValueError: ``ids`` is not 3-D or holds an id outside ``[-1, E)``.
    """
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"ids must be (T, L, k), got shape {ids.shape}")
    num_layers = ids.shape[1]
    if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [-1, {num_experts}), got [{ids.min()}, {ids.max()}]")
    valid = ids >= 0
    layer = np.broadcast_to(np.arange(num_layers, dtype=np.int64)[None, :, None], ids.shape)
    key = layer[valid] * num_experts + ids[valid].astype(np.int64)
    counts = np.bincount(key, minlength=num_layers * num_experts)
    return counts.reshape(num_layers, num_experts).astype(EAM_DTYPE, copy=False)


def layer_counts(seq: np.ndarray, experts: np.ndarray, num_seqs: int, num_experts: int) -> np.ndarray:
    """One MoE layer's iteration-EAM rows for a batch, attributed to sequences.

    NOTE: one ``bincount`` on ``seq * E + expert`` counts every (token, choice) pair into its
    sequence's row, so batching never mixes sequences and there is no per-token Python loop.

    Args:
        seq: ``(T,)`` int sequence index of each token, in ``[0, num_seqs)``.
        experts: ``(T, k)`` int expert ids.
        num_seqs: ``B``.
        num_experts: ``E``.

    Returns:
        ``(B, E)`` int64; row ``b`` sums to ``k *`` (tokens of sequence ``b``).
    """
    key = (np.asarray(seq, dtype=np.int64) * num_experts)[:, None] + experts
    counts = np.bincount(key.ravel(), minlength=num_seqs * num_experts)
    return counts.reshape(num_seqs, num_experts)


def normalize_rows(eam: np.ndarray) -> np.ndarray:
    """L2-normalise each row (last axis) of ``(..., L, E)``; zero rows stay zero.

    Returns a new C-contiguous float32 array of the same shape (faiss ``fvec_renorm_L2``: one
    C call, ~1 us for a 32 x 8 EAM, where the numpy equivalent costs ~4 us).
    """
    x = np.array(eam, dtype=np.float32, order="C")
    if x.size:
        num_experts = x.shape[-1]
        faiss.fvec_renorm_L2(num_experts, x.size // num_experts, faiss.swig_ptr(x))
    return x


def row_sums(eam: np.ndarray) -> np.ndarray:
    """Sum over experts: ``(..., L, E) -> (..., L)``."""
    return np.asarray(eam).sum(axis=-1)


def activation_probability(entries: np.ndarray) -> np.ndarray:
    """Aggregate matched EAMs into per-layer activation probabilities (MoE-Infinity §5.1, step 2).

    Args:
        entries: ``(n, L, E)`` matched EAMs (normalised or raw counts).

    Returns:
        ``(L, E)`` float32: the entries summed, each row scaled to sum 1 (zero rows stay zero).
    """
    total = np.asarray(entries, dtype=np.float32).sum(axis=0)
    sums = total.sum(axis=-1, keepdims=True)
    return np.divide(total, sums, out=np.zeros_like(total), where=sums > 0)


def prefix_query(request_eam_so_far: np.ndarray, iteration_eam: np.ndarray, upto_layer: int) -> np.ndarray:
    """The EAM a request has shown while MoE layer ``upto_layer`` of the current step runs.

    Args:
        request_eam_so_far: ``(L, E)`` counts of the request's earlier steps (prefill + decode).
        iteration_eam: ``(L, E)`` counts of the current step (only rows ``<= upto_layer`` used).
        upto_layer: last MoE layer routed in the current step, ``-1`` for none.

    Returns:
        ``(L, E)`` float32 counts: ``request_eam_so_far`` plus the current step's rows
        ``0..upto_layer``. Rows the request has not reached yet are zero, which is what prefix
        matching in :meth:`tracer.eamc.EAMC.search` expects.
    """
    query = np.array(request_eam_so_far, dtype=np.float32)
    query[: upto_layer + 1] += np.asarray(iteration_eam, dtype=np.float32)[: upto_layer + 1]
    return query


@dataclass(slots=True)
class RequestEAM:
    """A request EAM: prefill and decode counts kept apart (MoE-Infinity §4.1).

    Attributes:
        prefill: ``(L, E)`` int64 counts of the prompt tokens.
        decode: ``(L, E)`` int64 counts of the generated tokens.
    """

    prefill: np.ndarray
    decode: np.ndarray

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> RequestEAM:
        return cls(empty_eam(num_layers, num_experts), empty_eam(num_layers, num_experts))

    def add(self, iteration_eam: np.ndarray, prefill: bool) -> None:
        """Add one step's iteration EAM ``(L, E)`` to the prefill or decode counts."""
        (self.prefill if prefill else self.decode)[...] += iteration_eam

    def total(self) -> np.ndarray:
        """``(L, E)`` int64 prefill + decode counts (what the EAMC stores)."""
        return self.prefill + self.decode
