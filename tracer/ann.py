"""Approximate search for large EAM collections: a faiss IVF index kept in step with the EAMC.

NOTE: an exact search reads every entry (``capacity * L * E`` floats per query), which grows past
a millisecond at ~20k entries of a 35 x 128 model on one core. ``IVFIndex`` clusters the entries
into ``nlist`` cells (spherical k-means, inner product) and scans only the ``nprobe`` cells closest
to each query. It is trained once, when the collection first holds ``train_after`` entries
(until then the EAMC searches exactly); later entries are assigned to the nearest of those
centroids. Overwrites (EAMC replacement) go through ``update_vectors`` on a hash-table direct map,
so a slot id always names the same row of the EAMC matrix. HNSW was not used: it cannot replace
an entry in place. Recall against the exact search is measured by
``moeserve bench eamc --index ivf`` (figures in ``docs/tracer.md``).
"""

from __future__ import annotations

import math

import faiss
import numpy as np


class IVFIndex:
    """IVF-Flat inner-product index over the EAMC's ``(capacity, L*E)`` matrix.

    Args:
        dim: ``L * E``.
        capacity: EAMC capacity (sets the defaults).
        nlist: cells; default ``round(sqrt(capacity))``.
        nprobe: cells scanned per query; default ``max(1, nlist // 8)``.
        train_after: entries needed before training; default ``min(capacity, max(1000, 40 * nlist))``.
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        nlist: int | None = None,
        nprobe: int | None = None,
        train_after: int | None = None,
    ) -> None:
        self.dim = dim
        self.nlist = nlist or max(1, round(math.sqrt(capacity)))
        self.nprobe = min(self.nlist, nprobe or max(1, self.nlist // 8))
        self.train_after = train_after or min(capacity, max(1000, 40 * self.nlist))
        self.trained = False
        self._present = np.zeros(capacity, dtype=bool)
        self._index: faiss.IndexIVFFlat | None = None

    def put(self, data: np.ndarray, n: int, slot: int) -> None:
        """Row ``slot`` of ``data [C, dim]`` was (over)written; ``n`` rows are in use."""
        if not self.trained:
            if n >= self.train_after:
                self.rebuild(data, n)
            return
        assert self._index is not None
        ids = np.array([slot], dtype=np.int64)
        vec = data[slot : slot + 1]
        if self._present[slot]:
            self._index.update_vectors(ids, vec)
        else:
            self._index.add_with_ids(vec, ids)
            self._present[slot] = True

    def rebuild(self, data: np.ndarray, n: int) -> None:
        """Train on rows ``0..n-1`` of ``data`` and index them (ids = row numbers)."""
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, self.nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.spherical = True
        index.cp.seed = 1234
        index.train(np.ascontiguousarray(data[:n]))
        index.set_direct_map_type(faiss.DirectMap.Hashtable)
        index.add_with_ids(np.ascontiguousarray(data[:n]), np.arange(n, dtype=np.int64))
        index.nprobe = self.nprobe
        self._index = index
        self._quantizer = quantizer  # keep the quantizer alive as long as the index
        self._present[:] = False
        self._present[:n] = True
        self.trained = True

    def search(self, xq: np.ndarray, k: int, sims: np.ndarray, idx: np.ndarray) -> None:
        """Fill ``sims``/``idx`` ``(B, k)`` with the best matches of ``xq [B, dim]``.

        A query whose probed cells hold fewer than ``k`` entries gets ``idx = -1`` and
        ``sims = -inf`` in the missing places.
        """
        assert self._index is not None
        self._index.search(xq, k, D=sims, I=idx)
        sims[idx < 0] = -np.inf
