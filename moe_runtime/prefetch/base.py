"""Prefetch policy interface, the ``on-demand`` baseline and the plan builder all policies share.

A policy is called once per MoE layer per step, right after the router's top-k ids reach the host
(:meth:`PrefetchPolicy.after_routing`). It scores experts of later layers and hands the buffer a
re-prioritised plan (MoE-Infinity §5.1, "prefetching process"): the highest-scoring experts not yet
resident or loading, at most as many as there are slots a prefetch may take, nearer layers weighted
up by ``1 - (i - l) / L``; queued transfers that fell out of the plan are cancelled, in-flight ones
finish. A needed expert that is not resident becomes a demand fetch, which jumps every prefetch.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PrefetchPolicy:
    """Base class and the ``on-demand`` baseline: never prefetch (Mixtral-Offloading style).

    Args:
        buffer: the :class:`~moe_runtime.buffer.ExpertBuffer`.
        num_layers: L MoE layers; num_experts: E; top_k: experts per token.
        recorder: the tracer's ``RequestRecorder`` when tracing is on, else None.
        depth: how many later layers a plan may cover (multi-layer lookahead), >= 1.
    """

    name = "on-demand"
    #: True while the policy plans nothing and needs only the step's first MoE layer routed
    #: (``layer`` 0) to know a step began: the model then skips :meth:`after_routing` for the
    #: other layers (``moe_runtime.layers.moe.moe_block``). The ``eam`` policy derives it from
    #: its trial's arm (an arm without plans).
    idle = False

    def __init__(
        self,
        buffer: Any,
        num_layers: int,
        num_experts: int,
        top_k: int,
        recorder: Any | None = None,
        depth: int | None = None,
        **_: Any,
    ) -> None:
        self.buffer = buffer
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.recorder = recorder
        self.depth = max(1, depth or num_layers)

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """Called after MoE layer ``layer`` routed; ``topk_ids`` is ``[T, k]`` on the host."""

    def end_step(self) -> None:
        """Called once the step's last layer ran."""

    # ------------------------------------------------------------------ shared plan builder
    def proximity(self, layer: int) -> np.ndarray:
        """``[L]`` weights ``1 - (i - l) / L`` for layers ``l < i <= l + depth``, 0 elsewhere (§5.1)."""
        # The weights depend only on (layer, depth, L): cached per policy and shared, so callers
        # must not write to them. (Not flagged read-only: numba's dispatcher types a read-only
        # array on a slow path, ~50 us per call.)
        cache = self.__dict__.setdefault("_proximity_cache", {})
        key = (layer, self.depth, self.num_layers)
        w = cache.get(key)
        if w is None:
            i = np.arange(self.num_layers)
            w = 1.0 - (i - layer) / self.num_layers
            w[(i <= layer) | (i > layer + self.depth)] = 0.0
            cache[key] = w
        return w

    def issue(
        self, scores: np.ndarray, limit: int | None = None, first_layer: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Prefetch the best experts of ``scores [D, E]`` (0 = never) that are not resident or loading.

        ``scores`` rows are layers ``first_layer .. first_layer + D - 1`` (a window of the ``[L, E]``
        scores; layers outside it score 0). At most ``limit`` (default: the slots a prefetch may take
        now). Returns the plan handed to the buffer, ``(flat keys [n], priorities [n])`` best first;
        queued prefetches not in it are cancelled.
        """
        # The plan is the best ``k`` candidates (score > 0, stably sorted: equal scores in ascending
        # key order) that are not resident or loading (the buffer's ``held`` mask), selected and
        # queued in one compiled call (``TransferQueue.replan_best``), as this runs once per
        # planning MoE layer.
        # (the buffer reads its prefetch capacity in the same hold of its lock when limit is None)
        return self.buffer.prefetch_best(
            scores.reshape(-1), first_layer * self.num_experts, None if limit is None else max(limit, 0)
        )

    def issue_ranked(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Prefetch, as :meth:`issue` does, a plan the policy ranked itself: ``keys [n]`` (flat
        keys, int64, distinct, best first) with ``priorities [n]`` (float64, their scores); those
        resident or loading are skipped, at most the slots a prefetch may take now are queued,
        and queued prefetches not in it are cancelled (``buffer.prefetch_ranked``, one compiled
        call: ``TransferQueue.replan_ranked``)."""
        self.buffer.prefetch_ranked(keys, priorities)
