"""Decode steps replayed from CUDA graphs, one graph per batch size (vLLM's decode graphs).

On a GPU a decode step of a model whose experts all sit in device slots is host-bound: every
layer's norms, projections, rotary, KV write, FlexAttention call, router and grouped expert GEMMs
are about 40 kernel launches (``moeserve bench launches``), each costing the host more than the
GPU spends on it at batch 1. A CUDA graph records the step's kernels once and replays them with
one launch, so the step costs the host a few input copies and the replay.

What makes the forward capturable (``MoEModel.forward_device``): no host sync (the device-routed
experts of ``moe_runtime.layers.resident_experts`` hand their router ids to the host once per
step, after the graph), fixed shapes per batch size (FlexAttention reads persistent block-table
buffers sized for ``max_batch_size``: ``moe_runtime.layers.paged_decode``), and inputs that are
device tensors the step copies into the graph's own (token ids, positions, KV slots).

Per decode step of ``b`` sequences where :meth:`DecodeGraphs.eligible` holds:

* the first time at ``b``: a static copy of the step's device inputs, one eager warm-up run on a
  side stream (compiles FlexAttention at this shape, loads its buffers), then the capture into a
  memory pool shared by every batch size;
* every time: the new step's ids, positions and KV slots copied into the static inputs, the
  FlexAttention buffers loaded from its block tables (host work, one copy per block group), one
  replay, then the host's per-step work (``finish_step``) on the step's own request ids and a copy
  of the logits (the graph's output is overwritten by the next replay).

Anything else runs eagerly: prefill and mixed steps, offloaded or CPU-computed experts (whose
layers' attention blocks still replay graphs: ``moe_runtime.layers.attention_graphs``), a prefetch
policy or router lookahead that plans per layer, latent attention and the gathered attention path,
several devices, ``--enforce-eager``. A capture that fails turns the graphs off with a warning.

``emulate=True`` (tests) runs the same bookkeeping on any device with the stand-in of
``moe_runtime.layers.graph_capture``, which re-runs the forward on the static inputs: an input
not refreshed per step gives the stale step's tokens, which the CPU tests catch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moe_runtime.engine.context import StepContext
from moe_runtime.layers.graph_capture import WHOLE_STEP, capture, refresh, static_step
from moe_runtime.layers.resident_experts import finish_step

log = logging.getLogger(__name__)


class _Graph:
    """One batch size's captured decode forward: its static inputs, graph and outputs."""

    def __init__(self, ids: torch.Tensor, step: Any, graph: Any, outs: list[torch.Tensor], layers: list[int]):
        self.ids, self.step, self.graph = ids, step, graph
        self.logits = outs[0]
        # per device-routed MoE layer: (MoE layer, ids [b, k], weights [b, k]), the graph's outputs
        self.routed = [(layer, outs[1 + 2 * i], outs[2 + 2 * i]) for i, layer in enumerate(layers)]


class DecodeGraphs:
    """CUDA graphs of ``model``'s decode forward over the paged KV ``cache``, by batch size.

    Args:
        model: the ``MoEModel``. cache: its paged KV cache (FlexAttention decode: ``cache.flex``).
        emulate: use the CPU stand-in for the graphs (tests; see the module docstring).
    """

    def __init__(self, model: Any, cache: Any, emulate: bool = False) -> None:
        self.model, self.cache, self.emulate = model, cache, emulate
        self.enabled = True
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0
        self._pool = None if emulate else torch.cuda.graph_pool_handle()

    def eligible(self, step: Any) -> bool:
        """Whether ``step`` runs from a graph: a decode step whose every MoE layer is routed on the
        device and whose attention reads the blocks in place."""
        m = self.model
        if not (self.enabled and step.all_decode and step.logits_all) or m.mla is not None:
            return False
        if getattr(self.cache, "flex", None) is None or m.lookahead is not None:
            return False
        spans = m._resident()  # noqa: SLF001  (None while a policy plans per layer)
        return spans is not None and all(v is not None for v in spans.views)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: Any) -> torch.Tensor:
        """The step's logits ``[N, V]``, from a graph where :meth:`eligible`, else eagerly."""
        if not self.eligible(step):
            return self.model.forward(input_ids, step)
        b = input_ids.shape[0]
        g = self.graphs.get(b)
        if g is None:
            try:
                g = self.graphs[b] = self._capture(input_ids, step)
            except Exception as exc:  # noqa: BLE001  (any capture fault: keep serving eagerly)
                self.enabled = False
                log.warning("decode CUDA graphs off: capture at batch %d failed: %s", b, exc)
                step.device_routed.clear()
                return self.model.forward(input_ids, step)
        else:
            self._load(input_ids, step, g)
        g.graph.replay()
        self.replays += 1
        m = self.model
        finish_step(list(g.routed), m.buffer, step, m.recorder, m.cfg.num_experts)
        return g.logits.clone()

    def _load(self, input_ids: torch.Tensor, step: Any, g: _Graph) -> None:
        """``step``'s inputs into ``g``'s static ones, and its block tables into FlexAttention's."""
        g.ids.copy_(input_ids)
        refresh(g.step, step, self.cache)

    def _capture(self, input_ids: torch.Tensor, step: Any) -> _Graph:
        """Capture the decode forward at ``step``'s batch size, with static copies of its inputs."""
        ids = input_ids.clone()
        static = static_step(step, {WHOLE_STEP: True})

        def run() -> list[torch.Tensor]:
            static.device_routed.clear()
            logits = self.model.forward_device(ids, static)
            return [logits, *(t for _, i, w in static.device_routed for t in (i, w))]

        graph, outs = capture(run, self._pool, self.emulate)
        layers = [layer for layer, _, _ in static.device_routed]
        return _Graph(ids, static, graph, outs, layers)

    def describe(self) -> str:
        """A few words for the load summary."""
        if not self.enabled:
            return "decode CUDA graphs off (a capture failed)"
        return "decode CUDA graphs on (captured per batch size at first use)"


#: batch sizes captured before serving (larger ones at their first step): with offloaded experts
#: each size is one capture per layer, and each capture syncs the device
START_BATCHES = 16


def capture_at_start(graphs: DecodeGraphs | None, segments: Any | None, max_batch: int) -> int:
    """Capture the graphs of batch sizes 1 .. ``min(max_batch, START_BATCHES)`` before serving, so
    no live step of those sizes pays a capture (each one syncs the device): the whole-step graph
    where it applies, else each layer's attention block (``moe_runtime.layers.attention_graphs``).
    Returns the graphs captured.

    The steps are stand-ins: ``b`` sequences of one token at position 0, every one in block 0
    (nothing is cached yet; a sequence writes a position's KV before it reads it), token id 0. Only
    the capture runs (its warm-up included), not the host's per-step work: no counter, trace or
    policy sees them. A fault is logged and leaves the rest to the lazy captures."""
    owner = graphs if graphs is not None else segments
    if owner is None:
        return 0
    model, cache = owner.model, owner.cache
    before = len(graphs.graphs if graphs is not None else ()) + len(segments.graphs if segments else ())
    device = model.device
    try:
        for b in range(1, min(max_batch, START_BATCHES) + 1):
            tables = [[[0] for _ in cache.windows] for _ in range(b)]
            names, ones = [f"capture-{i}" for i in range(b)], [1] * b
            step = StepContext.build(names, tables, [0] * b, ones, [True] * b, device, cache.block_size)
            ids = torch.zeros(b, dtype=torch.int64, device=device)
            if graphs is not None and graphs.eligible(step):
                if b not in graphs.graphs:
                    graphs.graphs[b] = graphs._capture(ids, step)  # noqa: SLF001
                continue
            seg = segments.begin(step) if segments is not None else None
            if seg is None:
                continue
            dtype = model.w["embed"].dtype
            x = torch.zeros(b, model.cfg.hidden_size, dtype=dtype, device=device)
            for layer, lw in enumerate(model.layers):
                seg.run(layer, lw, x, x)
    except Exception as exc:  # noqa: BLE001  (start serving; the lazy captures remain)
        log.warning("graphs not captured at start: %s", exc)
    after = len(graphs.graphs if graphs is not None else ()) + len(segments.graphs if segments else ())
    return after - before
