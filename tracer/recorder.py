"""The per-request expert-activation recorder (MoE-Infinity §4.1, the EAM; §5.2 its use).

:class:`RequestRecorder` runs on the engine thread. It builds each live request's expert
activation matrix (EAM, ``L x E`` counts of the experts each MoE layer routed the request's tokens
to, prompt and decode apart) from the routing of every step, answers the prefetch and cache
policies' reads of the EAMs so far, and commits a finished request's EAM to the EAM collection
(EAMC, :mod:`tracer.eamc`) and, when a trace writer is attached, its per-token choices to a trace
file.

The runtime calls, per engine step: :meth:`RequestRecorder.record` once per MoE layer (right after
routing), :meth:`~RequestRecorder.query` when a prefetch/cache policy wants the EAMs so far
(:meth:`~RequestRecorder.query_sum` their sum, :meth:`~RequestRecorder.query_rows` a few layers' rows), and
:meth:`~RequestRecorder.end_step` once the step's forward is done; per request:
:meth:`~RequestRecorder.begin_request` when it is admitted and :meth:`~RequestRecorder.finish`
(commit to the EAMC and the trace file) or :meth:`~RequestRecorder.abort` (drop) at the end;
:meth:`~RequestRecorder.credit` when the runtime skipped computing some of its tokens (a
prefix-cache hit) and hands their stored counts over instead (a trace file then lacks those
tokens' per-token choices).

``record`` only keeps a layer's ids; they are counted when something reads the counts. The slot
tables that hold the EAMs and that lazy count (one compiled call when the ids are few) are
:mod:`tracer.recorder_counts`; the per-token choices kept for a trace file are
:mod:`tracer.recorder_trace`. No per-token Python loop runs unless a trace writer is attached (it
needs the per-token choices).

Counting: each of a token's ``k`` choices counts once, so for every layer the row sum of a
request EAM equals ``top_k *`` (tokens of the request seen at that layer).

Not thread-safe: one engine thread drives it (the EAMC it commits to is read on the same thread).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from tracer.recorder_counts import DECODE, PREFILL, SlotCounts, as_index
from tracer.recorder_trace import LiveRequest, TraceChoices

if TYPE_CHECKING:
    from tracer.eamc import EAMC
    from tracer.trace_file import TraceWriter


class _RunningSum:
    """:meth:`RequestRecorder.query_sum`'s running state for one prompt weight: the ``(epoch,
    request ids)`` it holds, the earlier steps' ``[L, E]`` sum and the current step's rows up to
    ``upto`` (a new epoch, batch or an earlier layer starts it again)."""

    __slots__ = ("key", "base", "step", "upto")

    def __init__(self) -> None:
        self.key: tuple[int, list[str]] | None = None
        self.base = self.step = np.zeros(0)
        self.upto = -1


class RequestRecorder(SlotCounts, TraceChoices):
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
        self._init_counts(num_layers, num_experts)  # the slot tables, nothing pending
        self._live: dict[str, LiveRequest] = {}
        self._last_ids: list[str] | None = None
        self._last_rows: slice | np.ndarray = np.zeros(0, dtype=np.int64)  # _rows(_last_ids)
        self._query_memo: tuple[int, list[str], np.ndarray] | None = None  # dropped when counts change
        self._sums: dict[float, _RunningSum] = {}  # query_sum's running state per prompt weight
        self.committed = 0
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
        self._live[request_id] = LiveRequest(heapq.heappop(self._free), prompt_len, task)
        self._last_ids = self._query_memo = None
        self.epoch += 1
        self.live_changes += 1

    def _rows(self, request_ids: list[str]) -> slice | np.ndarray:
        """Index of the requests' slots in the slot tables (see :func:`tracer.recorder_counts.as_index`).

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
        self._last_ids, self._last_rows = list(request_ids), as_index(slots)
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

    # -- per step ---------------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the iteration: add every touched request's iteration EAM into its request EAM."""
        self._end_step_counts()
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
                run.base = phases[DECODE] + w * phases[PREFILL]
            run.step = np.zeros_like(run.base)
            run.upto = -1
            run.key = (self.epoch, list(request_ids))
        if upto_layer > run.upto:
            lo, hi = run.upto + 1, upto_layer + 1
            if w == 1.0:
                run.step[lo:hi] = self._step_sum[rows, lo:hi].sum(axis=0)
            else:
                step = self._step[rows, :, lo:hi].sum(axis=0)  # [2, span, E]
                run.step[lo:hi] = step[DECODE] + w * step[PREFILL]
            run.upto = upto_layer
        return run.base + run.step

    def request_eam(self, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """``(prefill, decode)`` ``(L, E)`` int64 copies of the request EAM (finished steps only).

        Raises:
            KeyError: the request is not live.
        """
        slot = self._get(request_id).slot
        self._flush()
        return self._eam[slot, PREFILL].copy(), self._eam[slot, DECODE].copy()

    def credit(self, request_id: str, counts: np.ndarray, decode: bool = False) -> None:
        """Add routing computed elsewhere to a live request's EAM, as counts of finished steps.

        A serving runtime that skips a prompt prefix (a prefix-cache hit: the KV blocks were
        computed for an earlier request) credits the request with the counts stored with those
        blocks, so its EAM, the EAMC entry it commits and the policies' reads equal a full prefill's.

        Args:
            counts: ``(L, E)`` non-negative integer counts (each token's choices, once per layer).
            decode: count them as generated tokens' (default: prompt tokens').

        Raises:
            KeyError: the request is not live.
            ValueError: ``counts`` is not ``(L, E)`` or has negative entries.
        """
        slot = self._get(request_id).slot
        counts = np.asarray(counts)
        if counts.shape != (self.num_layers, self.num_experts) or (counts < 0).any():
            raise ValueError(
                f"credit counts must be non-negative ({self.num_layers}, {self.num_experts}), "
                f"got shape {counts.shape}"
            )
        self._flush()
        self._eam[slot, DECODE if decode else PREFILL] += counts.astype(self._eam.dtype, copy=False)
        self._sum[slot] += counts.astype(np.float32)
        self._query_memo = None
        self.epoch += 1

    def _get(self, request_id: str) -> LiveRequest:
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

    @property
    def live_requests(self) -> list[str]:
        """Ids of the requests being recorded."""
        return list(self._live)
