"""Per-request expert-activation recording on the engine thread (MoE-Infinity §4.1, §5.2).

The runtime calls, per engine step: :meth:`RequestRecorder.record` once per MoE layer (right after
routing), :meth:`~RequestRecorder.query` when a prefetch/cache policy wants the EAMs so far
(:meth:`~RequestRecorder.query_sum` their sum, :meth:`~RequestRecorder.query_rows` a few layers' rows), and
:meth:`~RequestRecorder.end_step` once the step's forward is done; per request:
:meth:`~RequestRecorder.begin_request` when it is admitted and :meth:`~RequestRecorder.finish`
(commit to the EAMC and the trace file) or :meth:`~RequestRecorder.abort` (drop) at the end.

NOTE: storage. Every live request owns a slot in two preallocated tables of shape
``(slots, 2, L, E)`` int64 (phase 0 = prefill, 1 = decode): ``_eam`` holds the request EAMs of
finished steps, ``_step`` the current step's iteration EAMs; float32 copies summed over the phase
(``_sum``, ``_step_sum``) make :meth:`RequestRecorder.query` one copy and one add. Free slots are
handed out lowest first, so a batch admitted together holds consecutive ascending slots and is
indexed with a slice (basic indexing, no gather/scatter); other batches use the slot array.

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
moves :attr:`RequestRecorder.epoch`). Decoding that nobody queries (on-demand, or the ``eam``
policy's lean mode) thus costs no numpy call per layer: on the bundled model the per-layer count
had cost the compute thread about 45 us of CPU time per MoE layer (cold caches between the expert
GEMMs), ``record`` now about 5 us and the deferred counting about 1 us per layer
(``tools/lean_cost.py``). The expert ids are checked when counted. No per-token Python loop runs
unless a trace writer is attached (it needs the per-token choices).

Counting: each of a token's ``k`` choices counts once, so for every layer the row sum of a
request EAM equals ``top_k *`` (tokens of the request seen at that layer).

Not thread-safe: one engine thread drives it (the EAMC it commits to is read on the same thread).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from tracer.eam import EAM_DTYPE
from tracer.jit import njit

if TYPE_CHECKING:
    from tracer.eamc import EAMC
    from tracer.trace_file import TraceRecord, TraceWriter

_PREFILL, _DECODE = 0, 1
# pending layers of finished steps beyond which end_step counts them (bounds the memory kept)
MAX_PENDING_LAYERS = 1024


class _RunningSum:
    """:meth:`RequestRecorder.query_sum`'s running state for one prompt weight: the ``(epoch,
    request ids)`` it holds, the earlier steps' ``[L, E]`` sum and the current step's rows up to
    ``upto`` (a new epoch, batch or an earlier layer starts it again)."""

    __slots__ = ("key", "base", "step", "upto")

    def __init__(self) -> None:
        self.key: tuple[int, list[str]] | None = None
        self.base = self.step = np.zeros(0)
        self.upto = -1


class _Live:
    """Bookkeeping of one live request (slot, trace metadata, per-token choices if tracing)."""

    __slots__ = ("slot", "prompt_len", "task", "ids", "weights", "prefill_tokens", "pending")

    def __init__(self, slot: int, prompt_len: int, task: str | None) -> None:
        self.slot, self.prompt_len, self.task = slot, prompt_len, task
        self.ids: list[np.ndarray] = []  # per step: (n, L, k) int64, -1 = layer not recorded
        self.weights: list[np.ndarray] = []  # per step: (n, L, k) float32
        self.prefill_tokens = 0
        self.pending: dict[int, tuple[np.ndarray, np.ndarray, bool]] = {}  # layer -> this step's rows


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
        # its slot's block in a (slots, L, E) one (RequestRecorder._add's sparse form); made on
        # first use
        self.flat: tuple[np.ndarray, np.ndarray] | None = None
        self.ids: list[np.ndarray] = []
        self.layers: list[int] = []
        self.done = 0
        self.shape: tuple[int, ...] | None = None  # (T, k) of the ids


class RequestRecorder:
    """Iteration and request EAMs of the live requests; commits finished ones.

    Args:
        num_layers: ``L``, MoE layers (``moe_layer`` indices are ``0..L-1``).
        num_experts: ``E``.
        top_k: experts per token.
        eamc: collection that :meth:`finish` adds request EAMs (prefill + decode) to, or None.
        trace_writer: writer that :meth:`finish` appends the request's trace line to, or None.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        eamc: EAMC | None = None,
        trace_writer: TraceWriter | None = None,
    ) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.eamc, self.trace_writer = eamc, trace_writer
        _warm()  # compile (or load) the counting kernel now, not in the first request's first layer
        self._live: dict[str, _Live] = {}
        self._free: list[int] = []  # heap: the lowest free slot first
        self._eam = np.zeros((0, 2, num_layers, num_experts), dtype=EAM_DTYPE)
        self._step = np.zeros_like(self._eam)
        self._sum = np.zeros((0, num_layers, num_experts), dtype=np.float32)  # _eam summed over phase
        self._step_sum = np.zeros_like(self._sum)  # _step summed over phase
        self._touched = np.zeros(0, dtype=bool)
        self._last_ids: list[str] | None = None
        self._last_rows: slice | np.ndarray = np.zeros(0, dtype=np.int64)  # _rows(_last_ids)
        self._query_memo: tuple[int, list[str], np.ndarray] | None = None  # dropped when counts change
        self._sums: dict[float, _RunningSum] = {}  # query_sum's running state per prompt weight
        self.committed = 0
        self._group: _Pending | None = None  # layers recorded, not counted yet
        # bumped when an EAM of earlier steps or the set of live requests changes (see ``query``)
        self.epoch = 0
        # bumped only when the set of live requests changes (begin, finish, abort)
        self.live_changes = 0

    # -- requests ---------------------------------------------------------------------------------
    def begin_request(self, request_id: str, prompt_len: int, task: str | None = None) -> None:
        """Start tracing ``request_id`` (prompt of ``prompt_len`` tokens, optional task label).

        Raises:
            ValueError: the id is already live.
        """
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already being recorded")
        if not self._free:
            self._grow()
        self._live[request_id] = _Live(heapq.heappop(self._free), prompt_len, task)
        self._last_ids = self._query_memo = None
        self.epoch += 1
        self.live_changes += 1

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

    def _rows(self, request_ids: list[str]) -> slice | np.ndarray:
        """Index of the requests' slots in the slot tables (see :func:`_as_index`).

        Raises:
            KeyError: a request id is not live.
        """
        if request_ids == self._last_ids:
            return self._last_rows
        try:
            slots = np.fromiter(
                (self._live[r].slot for r in request_ids), dtype=np.int64, count=len(request_ids)
            )
        except KeyError as exc:
            raise KeyError(
                f"request {exc.args[0]!r} was not begun (begin_request) or already ended"
            ) from None
        self._last_ids, self._last_rows = list(request_ids), _as_index(slots)
        return self._last_rows

    # -- per layer --------------------------------------------------------------------------------
    def record(
        self,
        moe_layer: int,
        request_ids: list[str],
        token_seq: np.ndarray,
        token_prefill: np.ndarray,
        topk_ids: np.ndarray,
        topk_weights: np.ndarray | None,
    ) -> None:
        """Count one MoE layer's routing of a batch into the requests' iteration EAMs.

        The counts are taken lazily (see the module note): a layer's ids are kept and counted
        together with the step's other layers when something reads them (:meth:`query`,
        :meth:`query_sum`, :meth:`end_step`, :meth:`finish`, :meth:`abort`), so a step that
        nobody queries costs a list append per layer. Pass the same ``token_seq`` and
        ``token_prefill`` objects for every layer of a step (the engine does): a new object
        starts a new batch of layers (correct, but counted apart).

        Args:
            moe_layer: index among MoE layers, ``0..L-1`` (not the decoder-layer index).
            request_ids: the batch's requests; ``token_seq`` indexes this list.
            token_seq: ``(T,)`` int64 batch position of each token; a request's tokens are
                contiguous and in order.
            token_prefill: ``(T,)`` bool, True for prompt tokens.
            topk_ids: ``(T, k)`` int64 expert ids, kept by reference until counted: do not
                change them in place before the next read or :meth:`end_step`.
            topk_weights: ``(T, k)`` float32 gate weights, kept only for trace files (None
                without a trace writer, see :attr:`needs_weights`).

        Raises:
            KeyError: a request id was not begun.
            ValueError: shapes disagree or the layer is out of range; an expert id out of range
                raises at the next read or :meth:`end_step` (the ids are checked when counted,
                all layers of the batch in one reduction), naming the layer.
        """
        if not 0 <= moe_layer < self.num_layers:
            raise ValueError(f"moe_layer {moe_layer} outside [0, {self.num_layers})")
        if not isinstance(topk_ids, np.ndarray):
            topk_ids = np.asarray(topk_ids)
        g = self._group
        if g is None or (request_ids is not g.request_ids and request_ids != g.request_ids):
            g = self._new_group(request_ids, token_seq, token_prefill)
        elif token_seq is not g.token_seq or token_prefill is not g.token_prefill:
            g = self._same_tokens(g, request_ids, token_seq, token_prefill)
        if topk_ids.shape != g.shape:
            if g.shape is not None or len(topk_ids.shape) != 2 or topk_ids.shape[0] != len(g.seq):
                raise ValueError(
                    f"topk_ids {topk_ids.shape} must be (T, k) with T = {len(g.seq)} (token_seq), "
                    f"k the same for every layer of a step"
                )
            g.shape = topk_ids.shape
        g.ids.append(topk_ids)
        g.layers.append(moe_layer)
        self._query_memo = None
        for run in self._sums.values():
            if moe_layer <= run.upto:  # a layer query_sum already summed changed again
                run.key = None
        if self.trace_writer is not None:
            self._keep_choices(
                moe_layer,
                request_ids,
                g.seq,
                g.prefill,
                np.asarray(topk_ids, np.int64),
                np.asarray(topk_weights, np.float32),
            )

    @property
    def needs_weights(self) -> bool:
        """Whether :meth:`record` uses the router weights (only a trace file keeps them): without
        it the caller may pass None and skip copying them to the host."""
        return self.trace_writer is not None

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
        shapes and the request ids (KeyError, ValueError as :meth:`record`)."""
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
        summed[rows] += counts[:, _PREFILL] + counts[:, _DECODE]

    def _keep_choices(
        self,
        moe_layer: int,
        request_ids: list[str],
        token_seq: np.ndarray,
        token_prefill: np.ndarray,
        topk_ids: np.ndarray,
        topk_weights: np.ndarray,
    ) -> None:
        order = np.argsort(token_seq, kind="stable")
        bounds = np.searchsorted(token_seq[order], np.arange(len(request_ids) + 1))
        weights = np.asarray(topk_weights, dtype=np.float32)
        for b, rid in enumerate(request_ids):
            rows = order[bounds[b] : bounds[b + 1]]
            if rows.size:
                prefill = bool(token_prefill[rows[0]])
                self._live[rid].pending[moe_layer] = (topk_ids[rows], weights[rows], prefill)

    def _flush_choices(self, live: _Live) -> None:
        """Move the current step's per-layer choices into ``(n, L, k)`` token rows."""
        if not live.pending:
            return
        n = max(ids.shape[0] for ids, _, _ in live.pending.values())
        k = next(iter(live.pending.values()))[0].shape[1]
        ids = np.full((n, self.num_layers, k), -1, dtype=np.int64)
        weights = np.zeros((n, self.num_layers, k), dtype=np.float32)
        for layer, (lid, lw, _) in live.pending.items():
            ids[: lid.shape[0], layer] = lid
            weights[: lw.shape[0], layer] = lw
        if any(prefill for _, _, prefill in live.pending.values()):
            live.prefill_tokens += n
        live.ids.append(ids)
        live.weights.append(weights)
        live.pending.clear()

    # -- per step ---------------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the iteration: add every touched request's iteration EAM into its request EAM."""
        g = self._group
        if g is not None and g.done < len(g.ids):  # the step recorded layers: they are earlier now
            g.done = len(g.ids)
            self.epoch += 1
            self._query_memo = None
            if g.done >= MAX_PENDING_LAYERS:
                self._flush()
        touched = np.flatnonzero(self._touched)
        if touched.size:
            rows = _as_index(touched)
            self._eam[rows] += self._step[rows]
            self._sum[rows] += self._step_sum[rows]
            self._step[rows] = 0
            self._step_sum[rows] = 0
            self._touched[rows] = False
            self._query_memo = None
            self.epoch += 1
        if self.trace_writer is not None:
            for live in self._live.values():
                self._flush_choices(live)

    def query(self, request_ids: list[str], upto_layer: int) -> np.ndarray:
        """The requests' EAMs so far, for EAMC matching and cache priorities (§5.1, §5.2).

        Args:
            request_ids: requests to return, in this order.
            upto_layer: last MoE layer routed in the current step (``-1``: none yet).

        Returns:
            ``(B, L, E)`` float32 counts: each request's EAM of earlier steps (prefill + decode)
            plus, for rows ``<= upto_layer``, the current step's iteration EAM. Raw counts; pass
            them to :meth:`tracer.eamc.EAMC.search`, which normalises rows. Read-only: the same
            array answers the same question until the counts change.

        While :attr:`epoch` stays the same (no step ended, no request began or ended), the
        earlier steps' EAMs are fixed and a later layer's query differs from an earlier one only
        in the rows routed in between: a policy may key its per-step work on ``epoch``.

        Raises:
            KeyError: a request id is not live.
        """
        self._flush()
        memo = self._query_memo
        if memo is not None and memo[0] == upto_layer and (memo[1] is request_ids or memo[1] == request_ids):
            return memo[2]  # the cache and prefetch policies ask the same question per layer
        rows = self._rows(request_ids)
        out = self._sum[rows]  # [B, L, E]
        if isinstance(rows, slice):
            out = out.copy()  # a view of the table; a gather already copied
        if upto_layer >= 0:
            out[:, : upto_layer + 1] += self._step_sum[rows, : upto_layer + 1]
        out.flags.writeable = False  # shared by every caller until the counts change
        self._query_memo = (upto_layer, list(request_ids), out)
        return out

    def query_rows(self, request_ids: list[str], lo: int, hi: int) -> np.ndarray:
        """Rows ``lo .. hi - 1`` of :meth:`query` once those layers are routed: ``(B, hi - lo, E)``
        float32 counts (a new array), each request's EAM of earlier steps plus the current
        step's counts recorded so far, of those layers only.

        Equal to ``query(request_ids, upto)[:, lo:hi]`` for any ``upto >= hi - 1`` (the same
        float32 additions, row by row) without building the ``(B, L, E)`` array: a policy that
        matches incrementally (:class:`tracer.prefix_match.PrefixMatcher`) reads only the rows
        routed since its last read.

        Raises:
            KeyError: a request id is not live.
            ValueError: ``not 0 <= lo <= hi <= L``.
        """
        if not 0 <= lo <= hi <= self.num_layers:
            raise ValueError(f"rows {lo}:{hi} outside [0, {self.num_layers}]")
        self._flush()
        rows = self._rows(request_ids)
        return self._sum[rows, lo:hi] + self._step_sum[rows, lo:hi]

    def query_sum(self, request_ids: list[str], upto_layer: int, prefill_weight: float = 1.0) -> np.ndarray:
        """:meth:`query` summed over the requests: ``(L, E)`` float32 token counts (a new array).

        Equal to ``query(request_ids, upto_layer).sum(axis=0)`` (counts are integers, exact in
        float32), without building the ``(B, L, E)`` array: the earlier steps' sum is taken once
        per :attr:`epoch` and batch, and each routed layer's rows are added once.

        With ``prefill_weight != 1`` each prompt token's choices count ``prefill_weight`` and each
        generated token's 1 (``decode + prefill_weight * prefill``, from the phase tables, kept
        the same way per weight; float64): the ``eam-reuse`` cache weighs the decode phase, whose
        routing the next decode step repeats, above the prompt's.

        Raises:
            KeyError: a request id is not live.
        """
        self._flush()
        rows = self._rows(request_ids)
        w = prefill_weight
        run = self._sums.get(w)
        if run is None:
            run = self._sums[w] = _RunningSum()
        key = run.key
        if key is None or key[0] != self.epoch or key[1] != request_ids or upto_layer < run.upto:
            if w == 1.0:
                run.base = self._sum[rows].sum(axis=0)
            else:
                phases = self._eam[rows].sum(axis=0)  # [2, L, E] int64
                run.base = phases[_DECODE] + w * phases[_PREFILL]
            run.step = np.zeros_like(run.base)
            run.upto = -1
            run.key = (self.epoch, list(request_ids))
        if upto_layer > run.upto:
            lo, hi = run.upto + 1, upto_layer + 1
            if w == 1.0:
                run.step[lo:hi] = self._step_sum[rows, lo:hi].sum(axis=0)
            else:
                step = self._step[rows, :, lo:hi].sum(axis=0)  # [2, span, E]
                run.step[lo:hi] = step[_DECODE] + w * step[_PREFILL]
            run.upto = upto_layer
        return run.base + run.step

    def request_eam(self, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """``(prefill, decode)`` ``(L, E)`` int64 copies of the request EAM (finished steps only).

        Raises:
            KeyError: the request is not live.
        """
        slot = self._get(request_id).slot
        self._flush()
        return self._eam[slot, _PREFILL].copy(), self._eam[slot, _DECODE].copy()

    def _get(self, request_id: str) -> _Live:
        try:
            return self._live[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} was not begun (begin_request) or already ended") from None

    # -- end of a request -------------------------------------------------------------------------
    def finish(self, request_id: str) -> None:
        """Commit a finished request: its EAM (prefill + decode, the current step's counts
        included) goes into the EAMC if any, its trace line to the trace writer if any.

        A request that routed no token is released without a commit.

        Raises:
            KeyError: the request is not live.
        """
        live = self._get(request_id)
        slot = live.slot
        self._flush()
        if self._touched[slot]:
            self._eam[slot] += self._step[slot]
            self._step[slot] = 0
        total = self._eam[slot].sum(axis=0)  # [L, E]
        if self.eamc is not None and total.any():
            self.eamc.add(total)
        if self.trace_writer is not None:
            self._flush_choices(live)
            if live.ids:
                self.trace_writer.write(self._trace_record(request_id, live))
        self.committed += 1
        self._release(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request without committing anything.

        Raises:
            KeyError: the request is not live.
        """
        self._get(request_id)
        self._flush()
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        live = self._live.pop(request_id)
        self._group = None  # flushed by the caller; its slot index may name this request
        for table in (self._eam, self._step, self._sum, self._step_sum):
            table[live.slot] = 0
        self._touched[live.slot] = False
        heapq.heappush(self._free, live.slot)
        self._last_ids = self._query_memo = None
        self.epoch += 1
        self.live_changes += 1

    def _trace_record(self, request_id: str, live: _Live) -> TraceRecord:
        from tracer.trace_file import TraceRecord

        return TraceRecord(
            request_id=request_id,
            task=live.task,
            prompt_len=live.prompt_len,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_prefill=live.prefill_tokens,
            ids=np.concatenate(live.ids),
            weights=np.concatenate(live.weights),
        )

    @property
    def live_requests(self) -> list[str]:
        """Ids of the requests being recorded."""
        return list(self._live)


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


#: below ``cells / _SPARSE_RATIO`` ids, :meth:`RequestRecorder._add` scatter-adds them one by one.
#: Measured with cooled caches (a 16 MB pass between flushes): the scatter-add wins down to about
#: one id per 1-2 cells (4,096 cells: 512 ids 28 vs 31 us, 3,072 ids 32 vs 31 us; 196,608 cells:
#: 12,288 ids 100 vs 236 us).
_SPARSE_RATIO = 2


def _as_index(slots: np.ndarray) -> slice | np.ndarray:
    """``(B,)`` slots as an index into the slot tables: a slice when they are consecutive and
    ascending (basic indexing, which neither gathers nor scatters), else ``slots`` itself."""
    first = int(slots[0]) if slots.size else 0
    if slots.tolist() == list(range(first, first + slots.size)):
        return slice(first, first + slots.size)
    return slots
