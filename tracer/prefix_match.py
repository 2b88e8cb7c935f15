"""Incremental prefix matching: one EAMC query per MoE layer without rescanning every layer.

NOTE: why. The runtime matches once per MoE layer per step (MoE-Infinity §5.1), and from layer
``l - 1`` to layer ``l`` the query changes in one row only (row ``l`` gains this step's counts).
The score of an entry is a sum of per-layer cosines (:mod:`tracer.eamc`), so
:class:`PrefixMatcher` keeps the ``(L, B, n)`` table of per-layer cosines of the batch's queries
against the entries: :meth:`PrefixMatcher.begin_step` fills it from the EAMs of earlier steps (the
multiply-adds of one full search, skipping rows not reached yet), and
:meth:`PrefixMatcher.update` recomputes only row ``layer`` (``B * n * E`` multiply-adds instead
of ``B * n * L * E``) and lets a faiss heap pick the top ``k`` of the running sums. It reads the
EAMC's layer-major copy (:meth:`tracer.eamc.EAMC.layer_major`, made on first use; 2x memory).
:meth:`PrefixMatcher.update_rows` takes the changed rows alone (the recorder's
:meth:`tracer.recorder.RequestRecorder.query_rows`) and leaves the top ``k`` of
:attr:`PrefixMatcher.scores` to the caller (the ``eam`` policy's compiled copy of faiss's heap):
the same sums, bit for bit. Results equal :meth:`tracer.eamc.EAMC.search` on the same queries up
to float rounding (ties may order differently). It always scans exactly (never the IVF index), so
it suits the capacities the flat index serves (up to ~10k entries). ``begin_step`` costs about
a full search (one faiss call per layer), so it pays off when a step matches at many layers.

If the EAMC changes between ``begin_step`` and an ``update`` (an ``add``), the table is rebuilt
on that ``update`` from the current query rows.
"""

from __future__ import annotations

import faiss
import numpy as np

from tracer.eam import normalize_rows
from tracer.eamc import EAMC, _omp_threads

# widths that faiss ``fvec_inner_products_ny`` computes with kernels of its own (``_layer_cos``)
_NY_KERNELS = frozenset((1, 2, 4, 8, 12))


class PrefixMatcher:
    """Per-step incremental prefix matching of a batch against an EAMC.

    Args:
        eamc: the collection (read, never changed).
        k: matches per query.

    Typical use, per engine step, with the tracer's recorder::

        m.begin_step(recorder.query(request_ids, -1))  # EAMs of earlier steps
        for layer in range(L):                          # after routing layer `layer`
            sims, idx = m.update(layer, recorder.query(request_ids, layer))
            # or, reading only the changed row and leaving the top k to the caller:
            # m.update_rows([layer], recorder.query_rows(request_ids, layer, layer + 1)); m.scores
    """

    def __init__(self, eamc: EAMC, k: int = 4) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.eamc, self.k = eamc, k
        # the queries, normalised, layer-major: a layer's rows are one contiguous [B, E] block
        self._q = np.zeros((eamc.num_layers, 0, eamc.num_experts), dtype=np.float32)  # [L, B, E]
        self._by_layer = np.zeros((eamc.num_layers, 0, eamc.num_experts), dtype=np.float32)  # EAMC's
        self._cos = np.zeros((eamc.num_layers, 0, 0), dtype=np.float32)  # [L, B, n]
        self._sum = np.zeros((0, 0), dtype=np.float32)  # [B, n]
        self._version = -1
        self._heap: faiss.float_minheap_array_t | None = None
        self._sims = np.empty((0, 0), dtype=np.float32)
        self._idx = np.empty((0, 0), dtype=np.int64)
        self._ids = np.empty((0, 0), dtype=np.int64)  # [B, n] entry ids for _layer_cos

    def _layer_cos(self, by_layer: np.ndarray, layer: int, out: np.ndarray) -> None:
        """``out [B, n]`` = cosines of the queries' row ``layer`` with every entry's row ``layer``.

        NOTE: faiss (SIMD) on the EAMC's layer-major copy, not a numpy ``matmul``: numpy's
        multi-threaded BLAS stalls for milliseconds when the host is oversubscribed (measured:
        8 ms for a 16 x 128 x 10k product that takes 1.3 ms here). ``fvec_inner_products_by_idx``
        takes the whole batch in one call (16 queries at the Qwen3-30B-A3B shape: 11 -> 4 us);
        it computes each product with ``fvec_inner_product``, as ``fvec_inner_products_ny`` does
        for every width but the few it has own kernels for (``_NY_KERNELS``, whose sums round
        otherwise), so those widths keep one ``_ny`` call per query. There a query row that is
        zero gives zero without any work (the one-call form computes the same zeros).
        """
        slab = by_layer[layer]  # [n, E] contiguous
        num_experts, n = self.eamc.num_experts, slab.shape[0]
        rows = self._q[layer]  # [B, E] contiguous
        if num_experts not in _NY_KERNELS:
            batch = rows.shape[0]
            if self._ids.shape != (batch, n):
                self._ids = np.tile(np.arange(n, dtype=np.int64), (batch, 1))  # every entry, per query
            faiss.fvec_inner_products_by_idx(
                faiss.swig_ptr(out), faiss.swig_ptr(rows), faiss.swig_ptr(slab), faiss.swig_ptr(self._ids),
                num_experts, batch, n,
            )  # fmt: skip
            return
        seen = rows.any(axis=1)
        for b in range(rows.shape[0]):
            if seen[b]:
                faiss.fvec_inner_products_ny(
                    faiss.swig_ptr(out[b]), faiss.swig_ptr(rows[b]), faiss.swig_ptr(slab), num_experts, n
                )
            else:
                out[b] = 0.0

    def _rebuild(self) -> None:
        self._by_layer = by_layer = self.eamc.layer_major()  # [L, n, E], until the EAMC changes
        num_layers, n = by_layer.shape[0], by_layer.shape[1]
        self._cos = np.empty((num_layers, self._q.shape[1], n), dtype=np.float32)  # [L, B, n]
        for layer in range(num_layers):
            self._layer_cos(by_layer, layer, self._cos[layer])
        self._sum = self._cos.sum(axis=0)  # [B, n]
        self._version = self.eamc.version

    def begin_step(self, so_far: np.ndarray) -> None:
        """Start a step: ``so_far`` ``(B, L, E)`` are the batch's EAMs of earlier steps (raw counts;
        rows not reached yet zero). Costs about one full :meth:`EAMC.search`.

        Raises:
            ValueError: ``so_far`` is not ``(B, L, E)``.
        """
        so_far = np.asarray(so_far)
        shape = (self.eamc.num_layers, self.eamc.num_experts)
        if so_far.ndim != 3 or so_far.shape[1:] != shape:
            raise ValueError(f"so_far must be (B, {shape[0]}, {shape[1]}), got {so_far.shape}")
        self._q = normalize_rows(so_far.transpose(1, 0, 2))  # [L, B, E], rows one by one
        with _omp_threads(self.eamc.threads):
            self._rebuild()

    def update(self, layer: int | list[int], query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row ``layer`` of the queries changed; return the best ``k`` matches of each.

        Args:
            layer: the MoE layer just routed, or a list of layers routed since the last update
                (their rows are updated in order, the same as one call per layer, and the top ``k``
                taken once).
            query: ``(B, L, E)`` current queries (only the ``layer`` rows are read) or ``(B, E)``
                that row (one layer only).

        Returns:
            ``(sims, idx)``, both ``(B, min(k, len(eamc)))``, as :meth:`EAMC.search`.

        Raises:
            ValueError: the batch size differs from ``begin_step``'s or the shape is wrong.
        """
        query = np.asarray(query)
        layers = [layer] if isinstance(layer, int) else list(layer)
        if query.ndim != 3 and len(layers) != 1:
            raise ValueError("a (B, E) query row updates one layer; pass (B, L, E) for several")
        for lay in layers:
            row = query[:, lay] if query.ndim == 3 else query
            if row.shape != (self._q.shape[1], self.eamc.num_experts):
                raise ValueError(
                    f"query row must be ({self._q.shape[1]}, {self.eamc.num_experts}), got {row.shape}"
                )
            self._q[lay] = normalize_rows(row)
        with _omp_threads(self.eamc.threads):  # faiss heaps go parallel on large batches
            self._refresh(layers)
            return self._top_k()

    def update_rows(self, layers: list[int], rows: np.ndarray) -> None:
        """Rows ``layers`` of the queries changed to ``rows``; update the running sums
        (:attr:`scores`) as :meth:`update` does, without taking the top ``k`` (bit-identical
        sums: a caller may select the matches itself).

        Args:
            layers: the MoE layers routed since the last update, distinct, in routing order.
            rows: ``(B, len(layers), E)`` the queries' new rows (raw counts), in ``layers`` order.

        Raises:
            ValueError: ``rows`` has the wrong shape.
        """
        self._set_rows(layers, rows)
        # inline _omp_threads (a context manager costs a few us on this per-layer path)
        threads, prev = self.eamc.threads, faiss.omp_get_max_threads()
        if prev != threads:
            faiss.omp_set_num_threads(threads)
        try:
            self._refresh(layers)
        finally:
            if prev != threads:
                faiss.omp_set_num_threads(prev)

    def resume_step(self, layers: list[int], rows: np.ndarray) -> None:
        """Start a step from the last one's state: rows ``layers`` of the queries changed to
        ``rows`` (raw counts), every other row is current (it was set after its layer routed in
        the step before, so it already holds the earlier steps' counts). Their cosines are
        recomputed and the running sums re-added from the per-layer cosines, so the state is
        bit for bit what :meth:`begin_step` on the full queries makes, at the cost of the changed
        rows only (a decode step changes every row, but the caller took most of them in one by
        one as the last step routed them).

        Raises:
            ValueError: ``rows`` is not ``(B, len(layers), E)`` for the batch of the last step.
        """
        self._set_rows(layers, rows)
        with _omp_threads(self.eamc.threads):  # once per step: the context manager's cost is fine
            if self._version != self.eamc.version:
                self._rebuild()
                return
            for lay in layers:
                self._layer_cos(self._by_layer, lay, self._cos[lay])
            self._sum = self._cos.sum(axis=0)  # [B, n], as _rebuild sums them

    def _set_rows(self, layers: list[int], rows: np.ndarray) -> None:
        """Rows ``layers`` of the queries (``_q``) set to ``rows (B, len(layers), E)`` (raw counts),
        normalised one by one as :meth:`begin_step` normalises them.

        Raises:
            ValueError: ``rows`` has the wrong shape.
        """
        rows = np.asarray(rows)
        shape = (self._q.shape[1], len(layers), self.eamc.num_experts)
        if rows.shape != shape:
            raise ValueError(f"rows must be {shape}, got {rows.shape}")
        normed = normalize_rows(rows)
        if len(layers) == 1:
            self._q[layers[0]] = normed[:, 0]
        else:
            self._q[layers] = normed.transpose(1, 0, 2)

    @property
    def scores(self) -> np.ndarray:
        """``(B, n)`` float32 running sums of per-layer cosines of each query with every entry
        (what :meth:`update` takes the top ``k`` of); the matcher's own array: do not change it,
        and copy it to keep it past the next update."""
        return self._sum

    def _refresh(self, layers: list[int]) -> None:
        """Recompute the cosines of rows ``layers`` (from ``_q``) and the running sums; rebuild
        all rows if the EAMC changed since."""
        if self._version != self.eamc.version:
            self._rebuild()
            return
        by_layer = self._by_layer  # the EAMC's layer-major view (_rebuild): its version is unchanged
        for lay in layers:
            self._sum -= self._cos[lay]
            self._layer_cos(by_layer, lay, self._cos[lay])
            self._sum += self._cos[lay]

    def _top_k(self) -> tuple[np.ndarray, np.ndarray]:
        """faiss min-heaps (one per query) over the running sums; kept between calls (each SWIG
        call costs ~1 us, so the heap object and its buffers are made once per shape)."""
        batch, n = self._sum.shape
        k = min(self.k, n)
        if k == 0:
            return np.empty((batch, 0), dtype=np.float32), np.empty((batch, 0), dtype=np.int64)
        if self._heap is None or self._sims.shape != (batch, k):
            self._sims = np.empty((batch, k), dtype=np.float32)
            self._idx = np.empty((batch, k), dtype=np.int64)
            heap = faiss.float_minheap_array_t()
            heap.nh, heap.k = batch, k
            heap.val, heap.ids = faiss.swig_ptr(self._sims), faiss.swig_ptr(self._idx)
            self._heap = heap
        self._sims.fill(-np.inf)  # = heapify: every heap starts below any score
        self._heap.addn(n, faiss.swig_ptr(self._sum))
        self._heap.reorder()
        return self._sims.copy(), self._idx.copy()
