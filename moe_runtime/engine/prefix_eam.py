"""The expert trace of cached and recomputed KV blocks: what the tracer sees when a prefill is skipped
or repeated.

A prefix-cache hit skips computing a prompt prefix, and with it that prefix's routing; a
preemption by recompute computes a sequence's tokens a second time. The tracer's request EAM
(``tracer.recorder``, MoE-Infinity's expert activation matrix) must come out as if neither had
happened, since the EAMC and the ``eam`` policies match on it. So:

* :class:`BlockActivations` keeps, per KV block of one full-attention block group, the per-MoE-layer
  expert counts of the tokens written into it (``[L, E]`` uint8: a token counts an expert once
  per layer, a block holds at most ``block_size <= 255`` tokens). A block's row is cleared when
  its first position is written and filled as its tokens are routed, so a cached block carries
  its tokens' prefill activation. Host memory: ``L * E`` bytes per block (32 KiB per 64 blocks at
  the bundled model's 8 x 64; 14.5 KiB per block for DeepSeek-V3's 58 x 256), allocated when the
  tracer and prefix caching are both on.
* :class:`StepRecorder` stands between the model and the tracer's recorder for a step: it passes on
  only the tokens at positions the recorder has not counted yet (``Sequence.num_recorded``), so a
  recompute is not counted twice, and keeps each MoE layer's ids for :class:`BlockActivations`.
  A sequence admitted with a hit is credited its hit blocks' stored counts instead
  (``RequestRecorder.credit``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class BlockActivations:
    """Per KV block, the per-MoE-layer expert counts of its tokens.

    Args:
        num_blocks: blocks in the pool; num_layers: MoE layers ``L``; num_experts: ``E``.
    """

    def __init__(self, num_blocks: int, num_layers: int, num_experts: int) -> None:
        self.shape = (num_blocks, num_layers, num_experts)
        self._table: np.ndarray | None = None  # [num_blocks, L, E] uint8, allocated on first use

    @property
    def table(self) -> np.ndarray:
        if self._table is None:
            self._table = np.zeros(self.shape, dtype=np.uint8)
        return self._table

    def add(
        self, token_blocks: np.ndarray, token_first: np.ndarray, layers: list[tuple[int, np.ndarray]]
    ) -> None:
        """Count one step's routing into its tokens' blocks.

        Args:
            token_blocks: ``[T]`` int64, the block each token was written to.
            token_first: ``[T]`` bool, the token is its block's first position (the row starts over).
            layers: ``(moe_layer, ids [T, k])`` of every MoE layer the step routed.
        """
        table = self.table
        if token_first.any():
            table[token_blocks[token_first]] = 0
        if not layers:
            return
        _, L, E = self.shape
        ids = np.stack([x[1] for x in layers]).astype(np.int64, copy=False)  # [n, T, k]
        which = np.asarray([x[0] for x in layers], dtype=np.int64)
        flat = (token_blocks[None, :, None] * L + which[:, None, None]) * E + ids
        np.add.at(table.reshape(-1), flat.reshape(-1), 1)

    def counts(self, blocks: list[int] | tuple[int, ...]) -> np.ndarray:
        """``[L, E]`` int64: the counts of ``blocks`` summed."""
        if not blocks:
            return np.zeros(self.shape[1:], dtype=np.int64)
        return self.table[np.asarray(blocks, dtype=np.int64)].sum(axis=0, dtype=np.int64)


class StepRecorder:
    """The model's recorder for one step (see the module docstring); everything else is the
    wrapped recorder's.

    Args:
        recorder: the tracer's ``RequestRecorder`` (or any object with its ``record``).
        activations: where cached blocks keep their counts, or None (prefix caching off).
    """

    def __init__(self, recorder: Any, activations: BlockActivations | None) -> None:
        self.recorder = recorder
        self.activations = activations
        self._keep: np.ndarray | None = None
        self._seq: np.ndarray | None = None
        self._prefill: np.ndarray | None = None
        self._layers: list[tuple[int, np.ndarray]] = []

    @property
    def needs_weights(self) -> bool:
        return getattr(self.recorder, "needs_weights", True)

    def begin(self, token_seq: np.ndarray, token_prefill: np.ndarray, keep: np.ndarray | None) -> None:
        """Start a step: ``keep [T]`` bool marks the tokens the recorder counts (None: all)."""
        self._keep = keep
        if keep is not None:
            self._seq, self._prefill = token_seq[keep], token_prefill[keep]
        self._layers = []

    def record(self, moe_layer, request_ids, token_seq, token_prefill, topk_ids, topk_weights) -> None:
        """``RequestRecorder.record`` of the step's new tokens only."""
        if self.activations is not None:
            self._layers.append((moe_layer, topk_ids))
        keep = self._keep
        if keep is None:
            self.recorder.record(moe_layer, request_ids, token_seq, token_prefill, topk_ids, topk_weights)
            return
        weights = topk_weights[keep] if topk_weights is not None else None
        self.recorder.record(moe_layer, request_ids, self._seq, self._prefill, topk_ids[keep], weights)

    def end(self, token_blocks: np.ndarray | None, token_first: np.ndarray | None) -> None:
        """Close the step: its routing into the blocks of its tokens (when caching)."""
        if self.activations is not None and token_blocks is not None:
            self.activations.add(token_blocks, token_first, self._layers)
        self._layers = []
        self._keep = self._seq = self._prefill = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.recorder, name)
