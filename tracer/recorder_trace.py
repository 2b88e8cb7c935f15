"""The per-token expert choices a :class:`~tracer.recorder.RequestRecorder` keeps for its trace
file (:class:`TraceChoices`, a base of the recorder), and the trace line of a finished request.

Only a recorder with a trace writer keeps them: the EAMs count choices per layer and expert, a
trace line (``docs/trace-format.md``) holds each token's ``k`` expert ids and router weights per
layer. Without a trace writer none of this runs, and the router weights need not reach the host
(:attr:`~tracer.recorder.RequestRecorder.needs_weights`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tracer.trace_file import TraceRecord


class LiveRequest:
    """Bookkeeping of one live request (slot, trace metadata, per-token choices if tracing)."""

    __slots__ = ("slot", "prompt_len", "task", "ids", "weights", "prefill_tokens", "pending")

    def __init__(self, slot: int, prompt_len: int, task: str | None) -> None:
        self.slot, self.prompt_len, self.task = slot, prompt_len, task
        self.ids: list[np.ndarray] = []  # per step: (n, L, k) int64, -1 = layer not recorded
        self.weights: list[np.ndarray] = []  # per step: (n, L, k) float32
        self.prefill_tokens = 0
        self.pending: dict[int, tuple[np.ndarray, np.ndarray, bool]] = {}  # layer -> this step's rows


class TraceChoices:
    """Keeps each live request's per-token choices, layer by layer, and turns them into its trace
    line. A base of :class:`~tracer.recorder.RequestRecorder`, which sets the shape attributes and
    ``_live`` (request id -> :class:`LiveRequest`)."""

    num_layers: int
    num_experts: int
    top_k: int
    _live: dict[str, LiveRequest]

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

    def _flush_choices(self, live: LiveRequest) -> None:
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

    def _trace_record(self, request_id: str, live: LiveRequest) -> TraceRecord:
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
