"""The EAM Collection: a fixed-capacity set of past request EAMs (MoE-Infinity §4.2).

NOTE: matching. Entries are stored with every row L2-normalised and flattened to ``L * E``
float32 in one preallocated ``(capacity, L * E)`` matrix. A query is normalised the same way,
with the rows the request has not reached yet left zero, so the inner product of query and entry
is the sum, over the query's seen layers, of the per-layer cosine similarities. Each term lies in
``[0, 1]`` (counts are non-negative), so a query equal to a stored entry on ``s`` seen layers
scores ``s``; divide by ``s`` for a mean cosine in ``[0, 1]``. Ranking entries by this sum is the
paper's flattened-cosine matching made per-layer, which keeps a long prompt's prefill rows from
drowning the rows of the layers routed so far. Search is an exact inner-product k-NN by faiss
(``knn_inner_product`` straight on the preallocated matrix: no copy into an index, no Python loop
over entries), or an IVF index (:mod:`tracer.ann`) for collections past ~20k entries.

NOTE: replacement (§4.2, Fig. 5). While not full, ``add`` appends. When full, the new EAM
overwrites the entry most similar to it, which keeps the newest pattern and the diversity of the
rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from tracer import eam as _eam
from tracer.eamc_store import load_eamc, save_eamc

INDEX_KINDS = ("flat", "ivf")
BLAS_MIN_BATCH = 8  # batches this large search through faiss's BLAS path (see EAMC._knn)


@contextmanager
def _omp_threads(threads: int) -> Iterator[None]:
    """Run faiss with ``threads`` OpenMP threads, restoring the calling thread's setting after.

    NOTE: faiss parallelises even a one-query search or a one-vector IVF add over its OpenMP
    team; on a busy 2-core host a team of 2 waits for a descheduled thread and a 20 us search
    can take milliseconds. The setting is per calling thread, so restoring it leaves the rest
    of the process (torch, other faiss users) as it was.
    """
    prev = faiss.omp_get_max_threads()
    if prev == threads:
        yield
        return
    faiss.omp_set_num_threads(threads)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(prev)


@dataclass(slots=True)
class QueryStats:
    """Cumulative search cost: ``num_queries`` search calls (one call = one batch), ``seconds``."""

    num_queries: int = 0
    num_vectors: int = 0
    seconds: float = 0.0


# The serving default of the collection's size (``--eamc-capacity``): MoE-Infinity §7.5 (Figure 13)
# finds about 120 entries enough for every model it serves. On the bundled model's traces the
# precision of 128 entries is within 0.004 of 1,000's one layer ahead and 0.006 two ahead (400
# tasks), or above it (120 tasks), and the
# incremental matcher costs an eighth as much (Qwen3-30B-A3B shape, batch 16: a full match 1.2 ms
# against 9.6, one layer 27 us against 170): docs/tracer.md, ``moeserve bench eamc --capacities``.
DEFAULT_CAPACITY = 128


class EAMC:
    """Fixed-capacity EAM collection searched by per-layer cosine similarity (MoE-Infinity §4.2).

    Args:
        num_layers: ``L``, MoE layers of the model.
        num_experts: ``E``, experts per MoE layer.
        capacity: most entries kept (default :data:`DEFAULT_CAPACITY`; the paper finds about
            120 enough, §7.5).
        index: ``"flat"`` (exact, default) or ``"ivf"`` (approximate, for capacities past ~20k;
            exact until it holds enough entries to train, see :class:`tracer.ann.IVFIndex`).
        threads: OpenMP threads faiss may use per search (the calling thread's setting is
            restored afterwards); 1 keeps single-query latency steady on a busy host.
        fingerprint: model identity saved with the collection (architecture, ...); ``L`` and
            ``E`` are always part of it.
        nlist, nprobe: IVF cells and cells probed per query (``index="ivf"`` only).

    Raises:
        ValueError: a size is not positive or ``index`` is unknown.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity: int = DEFAULT_CAPACITY,
        index: str = "flat",
        *,
        threads: int = 1,
        fingerprint: dict[str, Any] | None = None,
        nlist: int | None = None,
        nprobe: int | None = None,
    ) -> None:
        if min(num_layers, num_experts, capacity, threads) <= 0:
            raise ValueError(
                f"num_layers, num_experts, capacity and threads must be positive, got "
                f"{num_layers}, {num_experts}, {capacity}, {threads}"
            )
        if index not in INDEX_KINDS:
            raise ValueError(f"index must be one of {INDEX_KINDS}, got {index!r}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.dim = num_layers * num_experts
        self.index_kind, self.threads = index, threads
        self.fingerprint: dict[str, Any] = {
            **(fingerprint or {}),
            "num_layers": num_layers,
            "num_experts": num_experts,
        }
        self._data = np.zeros((capacity, self.dim), dtype=np.float32)  # [C, L*E] row-normalised
        self._n = 0
        self.version = 0  # bumped by every add (lets PrefixMatcher notice a change)
        self._by_layer: np.ndarray | None = None  # [L, C, E] copy, made by layer_major()
        self.query_stats = QueryStats()
        self._ivf = None
        if index == "ivf":
            from tracer.ann import IVFIndex

            self._ivf = IVFIndex(self.dim, capacity, nlist=nlist, nprobe=nprobe)

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Most entries kept."""
        return self._data.shape[0]

    def __len__(self) -> int:
        return self._n

    def entries(self) -> np.ndarray:
        """``(n, L, E)`` float32 stored entries (each row L2-normalised), a read-only view.

        Copy it to keep it: a later :meth:`add` may overwrite a row.
        """
        view = self._data[: self._n].reshape(self._n, self.num_layers, self.num_experts)
        view.flags.writeable = False
        return view

    def layer_major(self) -> np.ndarray:
        """``(L, n, E)`` float32 read-only view of a layer-major copy of the entries.

        Made on the first call (one pass over the entries, then ``L * E`` more floats written per
        :meth:`add`; it doubles the memory), so row ``l`` of every entry is one contiguous
        ``(n, E)`` block (used by :class:`tracer.prefix_match.PrefixMatcher`).
        """
        if self._by_layer is None:
            n = self._n
            self._by_layer = np.zeros((self.num_layers, self.capacity, self.num_experts), dtype=np.float32)
            self._by_layer[:, :n] = (
                self._data[:n].reshape(n, self.num_layers, self.num_experts).transpose(1, 0, 2)
            )
        view = self._by_layer[:, : self._n]
        view.flags.writeable = False
        return view

    # -- add ------------------------------------------------------------------------------------
    def add(self, eam: np.ndarray) -> int:
        """Store a request EAM; returns the slot index it now occupies.

        Args:
            eam: ``(L, E)`` counts (prefill + decode request EAM) or any non-negative matrix.

        Returns:
            The slot (``0 <= slot < capacity``). While not full this is ``len(self) - 1`` after
            the call; when full it is the slot of the entry most similar to ``eam``, which is
            overwritten (MoE-Infinity §4.2, Fig. 5).

        Raises:
            ValueError: ``eam`` is not ``(L, E)``.
        """
        eam = np.asarray(eam)
        if eam.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"EAM must be ({self.num_layers}, {self.num_experts}), got {eam.shape}")
        vec = _eam.normalize_rows(eam).reshape(1, self.dim)
        if self._n < self.capacity:
            slot = self._n
            self._n += 1
        else:
            _, idx = self._knn(vec, 1)
            slot = int(idx[0, 0])
        self._data[slot] = vec[0]
        if self._by_layer is not None:
            self._by_layer[:, slot] = vec.reshape(self.num_layers, self.num_experts)
        self.version += 1
        if self._ivf is not None:
            with _omp_threads(self.threads):
                self._ivf.put(self._data, self._n, slot)
        return slot

    # -- search ---------------------------------------------------------------------------------
    def search(
        self, queries: np.ndarray, k: int = 4, normalized: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Find the ``k`` entries most similar to each query, for a whole batch in one call.

        Args:
            queries: ``(B, L, E)`` (or one ``(L, E)``) EAMs so far, rows not reached yet zero
                (see :meth:`prefix_query`); raw counts are fine, rows are L2-normalised here.
            k: matches per query.
            normalized: the rows are already L2-normalised (skips one pass over the batch).

        Returns:
            ``(sims, idx)``, both ``(B, min(k, len(self)))``, best first: ``sims`` float32 sum of
            per-layer cosines over the query's non-zero rows (so in ``[0, seen layers]``),
            ``idx`` int64 slots into :meth:`entries`.

        Raises:
            ValueError: ``queries`` has the wrong shape or ``k < 1``.
        """
        q = np.asarray(queries, dtype=np.float32)
        if q.ndim == 2:
            q = q[None]
        if q.ndim != 3 or q.shape[1:] != (self.num_layers, self.num_experts):
            raise ValueError(f"queries must be (B, {self.num_layers}, {self.num_experts}), got {q.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        t0 = time.perf_counter()
        if not normalized:
            q = _eam.normalize_rows(q)
        result = self._knn(np.ascontiguousarray(q.reshape(q.shape[0], self.dim)), k)
        stats = self.query_stats
        stats.num_queries += 1
        stats.num_vectors += q.shape[0]
        stats.seconds += time.perf_counter() - t0
        return result

    def _knn(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact (or IVF) inner-product k-NN of ``xq [B, L*E]`` among the stored entries."""
        n, nq = self._n, xq.shape[0]
        k = min(k, n)
        sims = np.empty((nq, k), dtype=np.float32)
        idx = np.empty((nq, k), dtype=np.int64)
        if k == 0:
            return sims, idx
        prev = faiss.omp_get_max_threads()  # inline _omp_threads: this is the hot path
        if prev != self.threads:
            faiss.omp_set_num_threads(self.threads)
        try:
            if self._ivf is not None and self._ivf.trained:
                self._ivf.search(xq, k, sims, idx)
            elif nq < BLAS_MIN_BATCH:
                faiss.knn_inner_product(
                    faiss.swig_ptr(xq), faiss.swig_ptr(self._data), self.dim, nq, n, k,
                    faiss.swig_ptr(sims), faiss.swig_ptr(idx),
                )  # fmt: skip
            else:
                # NOTE: faiss scans entry by entry per query unless the batch passes its BLAS
                # threshold (not met at our sizes); one sgemm reads the entries once for the
                # whole batch: measured 1.9x (32x8, 1k) to 4.5x (35x128, 1k) faster at batch 16,
                # but 3-4x slower at batch 1-2 (crossover ~4), hence BLAS_MIN_BATCH.
                saved = faiss.cvar.distance_compute_blas_threshold
                faiss.cvar.distance_compute_blas_threshold = 0
                try:
                    faiss.knn_inner_product(
                        faiss.swig_ptr(xq), faiss.swig_ptr(self._data), self.dim, nq, n, k,
                        faiss.swig_ptr(sims), faiss.swig_ptr(idx),
                    )  # fmt: skip
                finally:
                    faiss.cvar.distance_compute_blas_threshold = saved
        finally:
            if prev != self.threads:
                faiss.omp_set_num_threads(prev)
        return sims, idx

    @staticmethod
    def prefix_query(
        request_eam_so_far: np.ndarray, iteration_eam: np.ndarray, upto_layer: int
    ) -> np.ndarray:
        """``(L, E)`` float32 query for prefix matching; see :func:`tracer.eam.prefix_query`."""
        return _eam.prefix_query(request_eam_so_far, iteration_eam, upto_layer)

    # -- persistence (MoE-Infinity §5.3 "failure recovery") ---------------------------------------
    def save(self, path: str | Path, fingerprint: dict[str, Any] | None = None) -> None:
        """Write the entries and the model fingerprint atomically (temp file + ``os.replace``).

        ``fingerprint`` defaults to the one given at construction; ``L`` and ``E`` are added.
        See :func:`tracer.eamc_store.save_eamc` for the file layout.
        """
        save_eamc(self, path, fingerprint)

    @classmethod
    def load(cls, path: str | Path, fingerprint: dict[str, Any] | None = None, **kwargs: Any) -> EAMC:
        """Read a collection saved by :meth:`save`.

        Args:
            path: the ``.npz`` file.
            fingerprint: the model's fingerprint; when given, the file's must match it.
            kwargs: ``capacity``/``index``/``threads``/... overrides for the new collection.

        Raises:
            TracerError: the file is missing, corrupt, or of another model (one line, names the
                file and the field).
        """
        return load_eamc(cls, path, fingerprint, **kwargs)

    def _restore(self, entries: np.ndarray) -> None:
        """Fill a fresh collection with ``(n, L * E)`` already-normalised entries (loader only)."""
        n = entries.shape[0]
        self._data[:n] = entries
        self._n = n
        self._by_layer = None
        self.version += 1
        if self._ivf is not None and n >= self._ivf.train_after:
            with _omp_threads(self.threads):
                self._ivf.rebuild(self._data, n)
