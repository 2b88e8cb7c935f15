"""Each decoder layer's attention block of a decode step, replayed from a CUDA graph (the dense
segment between two host syncs: vLLM's piecewise graphs).

Where experts are offloaded, a decode step cannot be one graph: each MoE layer hands its router's
top-k ids to the host, which plans copies and waits for them (``moe_runtime.layers.moe``). The
part of the layer before that, from the normed input to the MoE input, has no host decision:
q/k/v, the q/k norms, rotary, the KV write, FlexAttention over the blocks, the o projection with
the residual, and the MLP norm. On a GPU that segment is about 15 kernel launches and a compiled
FlexAttention call whose Dynamo guard and wrapper cost the host about as much as the launches
(``moeserve bench launches``, ``host_top``). Here it is captured once per (layer, batch size) and
replayed:

* per step (:meth:`AttentionGraphs.begin`): the step's positions and KV slots copied into the
  batch size's static step, FlexAttention's block-table buffers loaded from the step's tables;
* per layer (:meth:`StepSegments.run`): the layer's input and normed input copied into the
  graph's, one replay; its outputs (the residual stream after attention, the MLP norm of it) are
  the graph's own tensors, read by the layer's MoE block before the next step replays them.

Only decode steps whose attention reads the blocks in place (FlexAttention, fixed-shape buffers)
qualify; not latent attention, not prefill or mixed steps, not inside a whole-step graph
(``moe_runtime.engine.decode_graphs``, which captures these layers itself). A capture that fails
turns these graphs off with a warning. ``emulate=True`` (tests) uses the CPU stand-in of
:mod:`moe_runtime.layers.graph_capture`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moe_runtime.layers.graph_capture import WHOLE_STEP, capture, refresh, static_step

log = logging.getLogger(__name__)


class AttentionGraphs:
    """The attention blocks of ``model``'s decode steps over the paged KV ``cache``, as graphs.

    Args:
        model: the ``MoEModel``. cache: its paged KV cache (``cache.flex`` set).
        emulate: the CPU stand-in for the graphs (tests).
    """

    def __init__(self, model: Any, cache: Any, emulate: bool = False) -> None:
        self.model, self.cache, self.emulate = model, cache, emulate
        self.enabled = True
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Any, list[torch.Tensor]]] = {}
        self.statics: dict[int, Any] = {}  # batch size -> its static step
        self.replays = 0
        self._pool = None if emulate else torch.cuda.graph_pool_handle()

    def begin(self, step: Any) -> StepSegments | None:
        """The step's segment runner, or None where its layers run eagerly (module docstring)."""
        if not (self.enabled and step.all_decode) or WHOLE_STEP in step.memo:
            return None
        if self.model.mla is not None or getattr(self.cache, "flex", None) is None:
            return None
        if not self.emulate and torch.cuda.is_current_stream_capturing():
            return None
        b = len(step.num_new)
        static = self.statics.get(b)
        if static is None:  # FlexAttention's buffers are loaded here, not by the captured blocks
            flex_loaded = {("flex", g): b for g in range(len(self.cache.windows))}
            static = self.statics[b] = static_step(step, flex_loaded)
        refresh(static, step, self.cache)
        return StepSegments(self, b, static)

    def describe(self) -> str:
        return "attention graphs on" if self.enabled else "attention graphs off (a capture failed)"


class StepSegments:
    """One step's attention blocks from graphs, at batch size ``b`` (``static``: its inputs)."""

    def __init__(self, owner: AttentionGraphs, b: int, static: Any) -> None:
        self.owner, self.b, self.static = owner, b, static

    def run(self, layer: int, lw: Any, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + o(attention(h)), mlp_norm(that))`` of layer ``layer`` for the normed ``h`` and
        the residual ``x`` ``[b, H]``; the eager block where a capture failed."""
        owner, m = self.owner, self.owner.model
        entry = owner.graphs.get((layer, self.b))
        if entry is None:
            if not owner.enabled:
                return self._eager(layer, lw, h, x)
            h_in, x_in, static = h.clone(), x.clone(), self.static

            def block() -> list[torch.Tensor]:
                rope = tuple(r.unsqueeze(1) for r in m.rotary.rows(static.positions))
                out = m._attention(h_in, x_in, lw, layer, static, rope)  # noqa: SLF001
                return [out, m._norm(out, lw.mlp_norm, lw.mlp_norm_bias)]  # noqa: SLF001

            try:
                graph, outs = capture(block, owner._pool, owner.emulate)  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001  (any capture fault: keep serving eagerly)
                owner.enabled = False
                log.warning("attention graphs off: layer %d, batch %d: %s", layer, self.b, exc)
                return self._eager(layer, lw, h, x)
            entry = owner.graphs[layer, self.b] = (h_in, x_in, graph, outs)
        else:
            entry[0].copy_(h)
            entry[1].copy_(x)
        entry[2].replay()
        owner.replays += 1
        return entry[3][0], entry[3][1]

    def _eager(self, layer: int, lw: Any, h: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        """The block without a graph, on the static step (its inputs are this step's)."""
        m, static = self.owner.model, self.static
        rope = tuple(r.unsqueeze(1) for r in m.rotary.rows(static.positions))
        out = m._attention(h, x, lw, layer, static, rope)  # noqa: SLF001
        return out, m._norm(out, lw.mlp_norm, lw.mlp_norm_bias)  # noqa: SLF001
