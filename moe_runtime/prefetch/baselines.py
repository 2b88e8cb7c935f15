"""Baseline prefetch policies the activation-aware one must beat, behind the same interface.

* ``next-layer-all`` — DeepSpeed-Inference's dependency prefetch: after layer ``l`` routes, fetch
  every expert of layer ``l + 1`` (MoE-Infinity §5.1, Figure 6a).
* ``model-counts`` — BrainStorm/DeepUM-style model-level tracing: lifetime activation counts over
  all requests rank the experts of later layers (Figure 6b).
* ``hot-experts`` — Klotski's correlation table: how often a token that chose expert ``a`` at
  layer ``l`` chooses ``b`` at ``l + 1``; the current tokens' choices predict the next layer
  (Klotski §4).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_runtime.prefetch.base import PrefetchPolicy


class NextLayerAllPrefetch(PrefetchPolicy):
    """Scores ``[L, E]``: 1 for every expert of layer ``l + 1``, 0 elsewhere (issued as that one row)."""

    name = "next-layer-all"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ones = np.ones((1, self.num_experts))

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        if layer + 1 >= self.num_layers:
            return
        self.issue(self._ones, first_layer=layer + 1)


class ModelCountsPrefetch(PrefetchPolicy):
    """Lifetime counts ``[L, E]``, updated with every routed token, row-normalised into
    probabilities and weighted by layer proximity.

    Only the routed layer's counts change, so only its row of the probabilities (``_prob [L, E]``,
    kept between calls; a row with no count yet is 0) is recomputed per call.
    """

    name = "model-counts"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = np.zeros((self.num_layers, self.num_experts))
        self._prob = np.zeros_like(self.counts)

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        row = self.counts[layer]
        row += np.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        total = row.sum()
        if total > 0:
            np.divide(row, total, out=self._prob[layer])
        lo = layer + 1  # earlier layers have proximity 0: issue only the later rows
        self.issue(self._prob[lo:] * self.proximity(layer)[lo:, None], first_layer=lo)


class HotExpertsPrefetch(PrefetchPolicy):
    """Correlation table ``[L-1, E, E]`` of consecutive-layer choices, learned online.

    The table holds integer counts, so adding the ``T * k * k`` pairs one by one (``np.add.at``)
    gives the same table as a ``bincount`` over all ``E * E`` cells, without touching every cell.
    """

    name = "hot-experts"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.table = np.zeros((max(1, self.num_layers - 1), self.num_experts, self.num_experts))
        self._prev: tuple[int, np.ndarray] | None = None

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        E = self.num_experts
        if self._prev is not None and self._prev[0] == layer - 1 and len(self._prev[1]) == len(topk_ids):
            prev = self._prev[1]  # [T, k] choices at layer - 1
            pairs = prev[:, :, None] * E + topk_ids[:, None, :]  # [T, k1, k2] flat cells of [E, E]
            np.add.at(self.table[layer - 1].reshape(-1), pairs.reshape(-1), 1.0)
        self._prev = (layer, topk_ids)
        if layer + 1 >= self.num_layers:
            return
        chosen = np.bincount(topk_ids.reshape(-1), minlength=E).astype(np.float64)  # [E]
        nxt = chosen @ self.table[layer]  # [E] expected co-activations at layer + 1
        total = nxt.sum()
        if total <= 0:
            return
        self.issue((nxt / total)[None], first_layer=layer + 1)  # scores of layer l + 1 only

    def end_step(self) -> None:
        self._prev = None
