"""Capturing a function's CUDA work into a graph, and the CPU stand-in the tests use.

Both users, the whole decode step (``moe_runtime.engine.decode_graphs``) and each layer's
attention block (``moe_runtime.layers.attention_graphs``), capture a function ``fn() -> [tensors]``
that reads only tensors at fixed addresses (static inputs, persistent buffers, weights) and
replay it after writing new values into those inputs. The graph's outputs are the tensors ``fn``
returned during the capture; every replay overwrites them in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

#: the memo key that marks a whole decode step's static step: inside it no layer is captured apart
WHOLE_STEP = "whole-step graph"


class Rerun:
    """The CPU stand-in for a CUDA graph: ``replay`` re-runs the captured function and writes its
    outputs into the first run's tensors, as a replay overwrites a graph's outputs in place. An
    input the caller forgot to refresh then gives the stale values a real replay would."""

    def __init__(self, fn: Callable[[], list[torch.Tensor]]) -> None:
        self.fn = fn
        self.outs: list[torch.Tensor] = fn()

    def replay(self) -> None:
        for out, new in zip(self.outs, self.fn()):
            out.copy_(new)


def capture(fn: Callable[[], list[torch.Tensor]], pool: Any, emulate: bool) -> tuple[Any, list[torch.Tensor]]:
    """``(graph, outputs)`` of ``fn``: one eager warm-up on a side stream (compiled kernels built,
    lazy buffers allocated), then the capture into the memory ``pool`` (``thread_local``: the I/O
    threads' own CUDA calls stay legal meanwhile). ``emulate``: a :class:`Rerun` instead (any
    device). The capture does not run the work: replay the graph once for the current inputs."""
    if emulate:
        graph = Rerun(fn)
        return graph, graph.outs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outs = fn()
    return graph, outs


def static_step(step: Any, memo: dict) -> Any:
    """A copy of ``step`` (a decode ``StepContext``) whose device inputs a graph reads, positions
    and each block group's KV slots, are its own tensors (refreshed by :func:`refresh`); host
    fields shared, ``memo`` as given, no per-step MoE records."""
    return dataclasses.replace(
        step,
        positions=step.positions.clone(),
        slots=[s.clone() for s in step.slots],
        memo=memo,
        moe_layers=[],
        device_routed=[],
    )


def refresh(static: Any, step: Any, cache: Any) -> None:
    """``step``'s positions and KV slots into ``static``'s tensors, and its block tables into the
    FlexAttention decode buffers of ``cache`` (every block group): the host work before a replay."""
    static.positions.copy_(step.positions)
    for mine, new in zip(static.slots, step.slots):
        mine.copy_(new)
    for group, window in enumerate(cache.windows):
        cache.flex.load(step, group, window)
