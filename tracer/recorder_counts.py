"""The recorder's count tables and their lazy count (:class:`SlotCounts`, a base of
:class:`tracer.recorder.RequestRecorder`), with the compiled kernel of the sparse count.

NOTE: storage. Every live request owns a slot in two preallocated tables of shape
``(slots, 2, L, E)`` int64 (phase 0 = prefill, 1 = decode): ``_eam`` holds the request EAMs of
finished steps, ``_step`` the current step's iteration EAMs; float32 copies summed over the phase
(``_sum``, ``_step_sum``) make :meth:`~tracer.recorder.RequestRecorder.query` one copy and one add.
Free slots are handed out lowest first, so a batch admitted together holds consecutive ascending
slots and is indexed with a slice (basic indexing, no gather/scatter); other batches use the slot
array.

NOTE: lazy counting. ``record`` only appends the layer's ``[T, k]`` ids (by reference) and its
index to the pending batch of layers; batch positions are mapped to slots, and each token's
``(seq * 2 + phase)`` block computed, once per batch, which lasts while the ``request_ids`` and the steps'
``token_seq`` / ``token_prefill`` contents stay the same (a batch decoding on). The pending layers
are counted together, one ``bincount`` on ``((seq * 2 + phase) * L + layer) * E + expert`` (or,
when the ids are few against the cells, a scatter-add at their flat indices), when something reads
the counts (``query``, ``query_sum``, ``query_rows``, ``request_eam``, ``finish``, ``abort``, a new
batch, or ``MAX_PENDING_LAYERS`` layers of finished steps): finished steps' layers go straight into
``_eam`` / ``_sum``, the current step's into ``_step`` / ``_step_sum``, which ``end_step`` adds
into ``_eam`` for the touched slots. ``end_step`` itself only marks the step's layers finished (and
moves :attr:`~tracer.recorder.RequestRecorder.epoch`). Decoding that nobody queries (on-demand, or
the ``eam`` policy's lean mode) thus costs no numpy call per layer: on the bundled model the
per-layer count had cost the compute thread about 45 us of CPU time per MoE layer (cold caches
between the expert GEMMs), ``record`` now about 5 us and the deferred counting about 1 us per layer
(``tools/lean_cost.py`` at 1e0523a). The expert ids are checked when counted.

The sparse count is one compiled call, :func:`_add_cells` (numba through :mod:`tracer.jit`; the
same function runs as plain Python where numba is missing, and ``tests/test_tracer_recorder_kernel.py``
checks both against ``np.add.at``).
"""

from __future__ import annotations

import heapq

import numpy as np

from tracer.eam import EAM_DTYPE
from tracer.jit import njit

PREFILL, DECODE = 0, 1  # phase index of the tables: prompt tokens, generated tokens
# pending layers of finished steps beyond which end_step counts them (bounds the memory kept)
MAX_PENDING_LAYERS = 1024


class _Pending:
    """The layers of one batch recorded and not counted yet: their ``[T, k]`` ids (the caller's
    arrays, by reference) and layer indices, the first ``done`` of them from finished steps, and
    the batch's per-token terms."""

    __slots__ = ("request_ids", "token_seq", "token_prefill", "seq", "prefill", "rows", "base")
    __slots__ += ("seq_bytes", "prefill_bytes", "ids", "layers", "done", "shape", "flat")

    def __init__(self, request_ids, token_seq, token_prefill, seq, prefill, rows, base) -> None:
        self.request_ids, self.token_seq, self.token_prefill = request_ids, token_seq, token_prefill
        self.seq, self.prefill, self.rows, self.base = seq, prefill, rows, base
        self.seq_bytes, self.prefill_bytes = seq.tobytes(), prefill.tobytes()
        # per token: flat offsets of its (slot, phase) block in a (slots, 2, L, E) table and of
        # its slot's block in a (slots, L, E) one (SlotCounts._add's sparse form); made on
        # first use
        self.flat: tuple[np.ndarray, np.ndarray] | None = None
        self.ids: list[np.ndarray] = []
        self.layers: list[int] = []
        self.done = 0
        self.shape: tuple[int, ...] | None = None  # (T, k) of the ids


class SlotCounts:
    """The slot tables of the live requests' EAMs and the batch of layers not counted yet (see
    the module notes).

    A base of :class:`~tracer.recorder.RequestRecorder`, which sets ``num_layers`` and
    ``num_experts``, maps request ids to slots (``_rows``), and owns ``epoch`` and the memo of
    its last query (``_query_memo``), both of which a count here moves or drops.
    """

    num_layers: int
    num_experts: int
    epoch: int
    _query_memo: tuple[int, list[str], np.ndarray] | None

    def _rows(self, request_ids: list[str]) -> slice | np.ndarray:
        """The requests' slots as an index into the tables (the recorder's)."""
        raise NotImplementedError

    def _init_counts(self, num_layers: int, num_experts: int) -> None:
        """Empty tables (no slots yet; :meth:`_grow` adds them) and nothing pending."""
        _warm()  # compile (or load) the counting kernel now, not in the first request's first layer
        self._free: list[int] = []  # heap: the lowest free slot first
        self._eam = np.zeros((0, 2, num_layers, num_experts), dtype=EAM_DTYPE)
        self._step = np.zeros_like(self._eam)
        self._sum = np.zeros((0, num_layers, num_experts), dtype=np.float32)  # _eam summed over phase
        self._step_sum = np.zeros_like(self._sum)  # _step summed over phase
        self._touched = np.zeros(0, dtype=bool)
        self._group: _Pending | None = None  # layers recorded, not counted yet

    def _grow(self) -> None:
        old = self._eam.shape[0]
        new = max(8, 2 * old)
        for name in ("_eam", "_step", "_sum", "_step_sum"):
            old_table = getattr(self, name)
            table = np.zeros((new, *old_table.shape[1:]), dtype=old_table.dtype)
            table[:old] = old_table
            setattr(self, name, table)
        self._touched = np.concatenate([self._touched, np.zeros(new - old, dtype=bool)])
        for slot in range(old, new):
            heapq.heappush(self._free, slot)

    def _same_tokens(
        self, g: _Pending, request_ids: list[str], token_seq: np.ndarray, token_prefill: np.ndarray
    ) -> _Pending:
        """``g`` again when a new step's ``token_seq`` and ``token_prefill`` equal its own (a
        batch decoding on: its layers keep piling up), else a new batch of layers."""
        if (
            isinstance(token_seq, np.ndarray)
            and isinstance(token_prefill, np.ndarray)
            and token_seq.tobytes() == g.seq_bytes
            and token_prefill.tobytes() == g.prefill_bytes
        ):
            g.token_seq, g.token_prefill = token_seq, token_prefill
            return g
        return self._new_group(request_ids, token_seq, token_prefill)

    def _new_group(
        self, request_ids: list[str], token_seq: np.ndarray, token_prefill: np.ndarray
    ) -> _Pending:
        """Count what is pending and start a new batch of layers for ``request_ids``; checks the
        shapes and the request ids (KeyError, ValueError as
        :meth:`~tracer.recorder.RequestRecorder.record`)."""
        self._flush()
        seq = np.asarray(token_seq, dtype=np.int64)
        prefill = np.asarray(token_prefill, dtype=bool)
        if seq.ndim != 1 or prefill.shape != seq.shape:
            raise ValueError(f"token_seq {seq.shape} and token_prefill {prefill.shape} must be (T,) each")
        rows = self._rows(request_ids)
        L, E = self.num_layers, self.num_experts
        # flat index into a (B, 2, L, E) table of each token's (sequence, phase) block
        base = seq * (2 * L * E) + (~prefill) * (L * E)
        self._group = _Pending(request_ids, token_seq, token_prefill, seq, prefill, rows, base)
        return self._group

    def _flush(self) -> None:
        """Count the pending layers' ids: those of finished steps into the request EAMs, the
        current step's into ``_step`` (one ``bincount`` or two ``np.add.at`` per part, ``_add``).

        Raises:
            ValueError: a pending layer holds an expert id outside ``[0, E)``; the pending layers
                are dropped.
        """
        g = self._group
        if g is None or not g.ids:
            return
        ids, layers, done = g.ids, g.layers, g.done
        g.ids, g.layers, g.done = [], [], 0
        E = self.num_experts
        # [T, k] for one layer (a read after each routed layer), else [n, T, k]. NOTE: concatenate,
        # not np.stack (Python-level, two numpy calls per layer): on the bundled model, caches cold
        # after the expert GEMMs, stacking a step's 8 layers took ~75 us of the compute thread.
        if len(ids) == 1:
            ids = np.asarray(ids[0], dtype=np.int64)
        else:
            ids = np.concatenate(ids).astype(np.int64, copy=False).reshape(len(layers), *g.shape)
        # one reduction checks both bounds: seen as uint64, a negative id is >= 2**63
        if ids.size and ids.view(np.uint64).max() >= E:
            per_layer = ids.reshape(len(layers), *ids.shape[-2:])
            bad = sorted({lay for lay, x in zip(layers, per_layer) if ((x < 0) | (x >= E)).any()})
            raise ValueError(
                f"expert ids must lie in [0, {E}), got [{ids.min()}, {ids.max()}] at MoE layer(s) {bad}"
            )
        # each id's cell ``layer * E + expert`` within its token's (sequence, phase) block
        if len(layers) == 1:
            cells = ids + layers[0] * E  # [T, k]
        else:
            cells = ids + (np.asarray(layers, dtype=np.int64) * E)[:, None, None]  # [n, T, k]
        if done:  # finished steps' layers
            self._add(g, cells if done == len(layers) else cells[:done], self._eam, self._sum)
        if done < len(layers):  # the current step's
            self._add(g, cells if done == 0 else cells[done:], self._step, self._step_sum)
            self._touched[g.rows] = True
        self._query_memo = None

    def _add(self, g: _Pending, cells: np.ndarray, table: np.ndarray, summed: np.ndarray) -> None:
        """Count ``cells [n, T, k]`` or ``[T, k]`` (each id's ``layer * E + expert``) into ``g``'s rows of
        ``table [slots, 2, L, E]`` and ``summed [slots, L, E]``.

        Dense (a bincount over all ``B * 2 * L * E`` cells, then two table adds) when the ids are
        many; sparse (each id added at its flat index into both tables, one compiled call,
        :func:`_add_cells`) when they are few against the cells: a planning layer's read flushes
        one to a few layers of ``T * k`` ids, and at batch 16 of the Qwen3-30B-A3B shape the dense
        form touches 196,608 cells per flush (~200 us against ~5). Both give the same integer
        counts."""
        B, L, E = len(g.request_ids), self.num_layers, self.num_experts
        rows = g.rows
        if cells.size * _SPARSE_RATIO < B * 2 * L * E:
            if g.flat is None:
                slots = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
                tok = slots[g.seq] * (2 * L * E)  # [T] each token's slot block in the table
                g.flat = (tok + (~g.prefill) * (L * E), tok // 2)  # [T] each
            _add_cells(table.reshape(-1), summed.reshape(-1), cells.ravel(), cells.shape[-1], *g.flat)
            return
        flat = (cells + g.base[:, None]).ravel()
        counts = np.bincount(flat, minlength=B * 2 * L * E).reshape(B, 2, L, E)
        table[rows] += counts
        summed[rows] += counts[:, PREFILL] + counts[:, DECODE]

    def _end_step_counts(self) -> None:
        """The counting half of :meth:`~tracer.recorder.RequestRecorder.end_step`: the step's
        pending layers become finished steps' (counted once ``MAX_PENDING_LAYERS`` pile up), and
        every touched slot's iteration EAM is added into its request EAM."""
        g = self._group
        if g is not None and g.done < len(g.ids):  # the step recorded layers: they are earlier now
            g.done = len(g.ids)
            self.epoch += 1
            self._query_memo = None
            if g.done >= MAX_PENDING_LAYERS:
                self._flush()
        touched = np.flatnonzero(self._touched)
        if touched.size:
            rows = as_index(touched)
            self._eam[rows] += self._step[rows]
            self._sum[rows] += self._step_sum[rows]
            self._step[rows] = 0
            self._step_sum[rows] = 0
            self._touched[rows] = False
            self._query_memo = None
            self.epoch += 1


_warmed = False


def _warm() -> None:
    """Compile (or load from numba's on-disk cache) :func:`_add_cells` once per process."""
    global _warmed
    if not _warmed:
        one = np.zeros(1, dtype=np.int64)
        _add_cells(np.zeros(1, dtype=EAM_DTYPE), np.zeros(1, dtype=np.float32), one, 1, one, one)
        _warmed = True


@njit(cache=True)
def _add_cells(
    table: np.ndarray,
    summed: np.ndarray,
    cells: np.ndarray,
    k: int,
    to_table: np.ndarray,
    to_summed: np.ndarray,
) -> None:
    """Count ``cells`` (the flattened ``[n, T, k]`` or ``[T, k]`` int64 ids, each ``layer * E +
    expert``) into the flat ``table`` (+1 at ``cell + to_table[token]``) and ``summed`` (+1.0,
    float32, at ``cell + to_summed[token]``); ``to_table``, ``to_summed`` ``[T]``: each token's
    block offsets. Repeated cells count each time (``np.add.at``'s result; the counts are
    integers, exact in float32 below 2**24, so the order of the adds does not change them). Two
    ``np.add.at`` calls took 7-8 us per flush (hot, Qwen3-30B-A3B shape, batch 1 and 16), this
    about 1.

    Token by token: each token's ids go into its own blocks, layer after layer, so the writes
    sweep forward through one request's rows instead of jumping between the batch's blocks at
    every id. A step's first read at batch 16 flushes the step before (47 layers, 6,016 ids,
    into 2 MB of tables gone cold): 85 -> 40 us in isolation (an 8 MB pass between flushes)."""
    T = to_table.size
    if T * k == 0:  # no tokens (or no choices): nothing to count
        return
    n = cells.size // (T * k)  # layers
    for t in range(T):
        a, b = to_table[t], to_summed[t]
        for lay in range(n):
            first = (lay * T + t) * k
            for j in range(first, first + k):
                table[cells[j] + a] += 1
                summed[cells[j] + b] += np.float32(1.0)


#: below ``cells / _SPARSE_RATIO`` ids, :meth:`SlotCounts._add` scatter-adds them one by one.
#: Measured with cooled caches (a 16 MB pass between flushes): the scatter-add wins down to about
#: one id per 1-2 cells (4,096 cells: 512 ids 28 vs 31 us, 3,072 ids 32 vs 31 us; 196,608 cells:
#: 12,288 ids 100 vs 236 us).
_SPARSE_RATIO = 2


def as_index(slots: np.ndarray) -> slice | np.ndarray:
    """``(B,)`` slots as an index into the slot tables: a slice when they are consecutive and
    ascending (basic indexing, which neither gathers nor scatters), else ``slots`` itself."""
    first = int(slots[0]) if slots.size else 0
    if slots.tolist() == list(range(first, first + slots.size)):
        return slice(first, first + slots.size)
    return slots
