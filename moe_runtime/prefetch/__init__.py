"""Prefetch policies: after each MoE layer's routing, decide which experts of later layers to load.

A policy receives the buffer (to queue prefetches with priorities and cancel stale ones) and, when
tracing is on, the request recorder. The runtime calls :meth:`PrefetchPolicy.after_routing` once
per MoE layer per step, right after the router's top-k ids reach the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_runtime.errors import ConfigError


class PrefetchPolicy:
    """Base class and the ``on-demand`` baseline: never prefetch (Mixtral-Offloading style).

    Args:
        buffer: the :class:`~moe_runtime.buffer.ExpertBuffer`.
        num_layers: L MoE layers; num_experts: E; top_k: experts per token.
        recorder: the tracer's ``RequestRecorder`` when tracing is on, else None.
    """

    name = "on-demand"

    def __init__(
        self, buffer: Any, num_layers: int, num_experts: int, top_k: int, recorder: Any | None = None
    ) -> None:
        self.buffer = buffer
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.recorder = recorder

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """Called after MoE layer ``layer`` routed; ``topk_ids`` is ``[T, k]`` on the host."""

    def end_step(self) -> None:
        """Called once the step's last layer ran."""


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {"on-demand": PrefetchPolicy}


def make_prefetch_policy(name: str, **kwargs: Any) -> PrefetchPolicy:
    if name not in PREFETCH_POLICIES:
        raise ConfigError(
            f"--prefetch-policy {name!r} is unknown (choose from {', '.join(PREFETCH_POLICIES)})"
        )
    return PREFETCH_POLICIES[name](**kwargs)
