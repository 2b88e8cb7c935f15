"""Decode steps on the CPU through one ``torch.compile``d forward (the CPU's counterpart of the
CUDA decode graphs, ``moe_runtime.engine.decode_graphs``).

On the CPU a decode step of a small model is host work: every layer's norms, projections, rotary,
KV write, attention, router and experts are about 40 aten ops (``moeserve bench launches``), and
each op's dispatch costs more than its arithmetic at batch 1. ``torch.compile`` (TorchInductor)
turns the whole step into a few generated C++ loops and the matmuls, with one call from Python.
On the bundled model at batch 1 with one thread that took a decode step from about 3.3 ms to
about 1.4 ms on the 2-core development host (docs/benchmarks.md has the measured figures).

What is compiled is the model's own forward (``MoEModel.forward_device``), so there is one
implementation of every family to keep right. A step runs compiled where :meth:`CompiledDecode.eligible`
holds: a decode step (one new token per sequence, every logit kept) of a model whose experts are
all resident and routed without a host decision (``moe_runtime.layers.resident_experts``: the
router's ids reach the host once, after the step), with full attention over gathered blocks
(``moe_runtime.layers.attention``), and no per-layer planning (latent attention, sliding windows
and a router lookahead run eagerly). Every other step runs eagerly, as it would without this.

Shapes: the context length (read from the decode mask's shape while compiling, not from an int
the compiler would specialise on) and the batch size are symbolic, marked so from each variant's
first compile, so two graphs serve every step: a batch of one (no mask; the compiler specialises
sizes of 1), and several sequences at any lengths (always masked). :meth:`CompiledDecode.warm_up`
compiles them before serving, with stand-in steps, and reports the seconds.

Outputs: the compiled step fuses the norms' reductions and the softmax, so its logits can differ
from the eager step's in the last bits of fp32 (greedy tokens agree; ``tests/test_compiled_decode.py``
checks both against the eager engine). In bf16 its fused loops keep fp32 intermediates where the
eager step rounds after each op, so the logits move by more (up to 0.6 on the bundled model).

``moeserve bench launches --compile-decode`` counts a compiled step's kernel calls (each generated
loop and each library call) with the profiler. ``--enforce-eager`` turns it off. A compile that
fails (no C++ compiler on the host, an unsupported op) turns it off with a warning and the steps run
eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch._dynamo.utils import counters

from moe_runtime.engine.context import StepContext
from moe_runtime.layers.graph_capture import WHOLE_STEP
from moe_runtime.layers.resident_experts import finish_step

log = logging.getLogger(__name__)


class CompiledDecode:
    """``model``'s decode forward compiled for the CPU, with the eager forward as the fallback.

    Args:
        model: the ``MoEModel`` (on the CPU). cache: its paged KV cache.
    """

    def __init__(self, model: Any, cache: Any) -> None:
        self.model, self.cache = model, cache
        self.enabled = True
        self.steps = 0  # decode steps run compiled
        self.compiles = 0  # graphs compiled (warm-up and any step that met a new variant)
        # what no step changes: latent attention and sliding windows run eagerly
        self._attention_ok = model.mla is None and all(w is None for w in cache.windows)
        forward = type(model).forward_device
        raw = getattr(forward, "__wrapped__", forward)  # without its inference_mode wrapper
        # inference_mode's tensors cannot be traced into views; the compiled step runs under no_grad.
        # Each generated loop records itself for torch.profiler (a flag check when no profiler runs;
        # no TPOT change measured), so a profile names every kernel a step calls (bench launches)
        self._fn = torch.compile(raw, dynamic=None, options={"cpp.enable_kernel_profile": True})

    def eligible(self, step: StepContext) -> bool:
        """Whether ``step`` runs compiled (module docstring)."""
        m = self.model
        if not (self.enabled and self._attention_ok and step.all_decode and step.logits_all):
            return False
        if m.lookahead is not None:  # set after load, when the prefetch policy uses it
            return False
        spans = m._resident()  # noqa: SLF001  (None while a policy plans per layer)
        return spans is not None and all(v is not None for v in spans.views)

    def forward(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The step's logits ``[N, V]`` (fp32): compiled where :meth:`eligible`, else eagerly."""
        if not self.eligible(step):
            return self.model.forward(input_ids, step)
        step.memo[WHOLE_STEP] = True  # the resident layers route on the device (model._resident)
        try:
            logits = self._call(input_ids, step)
        except Exception as exc:  # noqa: BLE001  (any compile fault: keep serving eagerly)
            self._off(exc)
            return self._eager(input_ids, step)
        self.steps += 1
        m = self.model
        finish_step(step.device_routed, m.buffer, step, m.recorder, m.cfg.num_experts)
        return logits

    def _call(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The compiled forward, counting the compiles it triggers."""
        frames = counters["frames"]["ok"]
        with torch.no_grad():
            logits = self._fn(self.model, input_ids, step)
        self.compiles += counters["frames"]["ok"] - frames
        return logits

    def _off(self, exc: Exception) -> None:
        self.enabled = False
        log.warning("compiled decode off: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def _eager(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The step eagerly, from a clean slate: a failed compile may have left the memo half
        built; keys and values it wrote are written again, with the same values."""
        step.memo.clear()
        step.device_routed.clear()
        step.moe_layers.clear()
        return self.model.forward(input_ids, step)

    def warm_up(self, max_batch: int) -> tuple[int, float]:
        """Compile the variants serving meets before it meets them (module docstring):
        ``(variants compiled, seconds)``. Stand-in steps: one token per sequence, token id 0, in
        the pool's first blocks (nothing is cached yet; a sequence writes a position's KV before it
        reads it); only the forward runs, so no counter, trace or policy sees them. A fault turns
        the compiled steps off (logged)."""
        if not self.enabled:
            return 0, 0.0
        bs, groups = self.cache.block_size, len(self.cache.windows)
        # context lengths per stand-in step: batch 1, then several sequences (of two lengths); the
        # context dims are symbolic from each one's compile, the batch dim from the second's
        variants = [[3]] + ([[2 * bs + 2, 3]] if max_batch > 1 else [])
        t0, done = time.perf_counter(), 0
        device = self.model.device
        for lens in variants:
            b = len(lens)
            width = max(-(-max(lens) // bs), 2)
            row = [[j % self.cache.num_blocks for j in range(i * width, (i + 1) * width)] for i in range(b)]
            tables = [[row[i]] * groups for i in range(b)]
            names, past = [f"warm-up-{i}" for i in range(b)], [n - 1 for n in lens]
            step = StepContext.build(names, tables, past, [1] * b, [True] * b, device, bs)
            if not self.eligible(step):
                break
            ids = torch.zeros(b, dtype=torch.int64, device=device)
            _mark_dynamic(ids, step)
            step.memo[WHOLE_STEP] = True
            try:
                self._call(ids, step)
            except Exception as exc:  # noqa: BLE001  (serve eagerly)
                self._off(exc)
                break
            done += 1
        return done, time.perf_counter() - t0

    def report(self, variants: int, seconds: float) -> str:
        """The start-up line after :meth:`warm_up`: what was compiled and how long it took."""
        if not self.enabled:
            return f"compiled decode step: off after {seconds:.1f} s (the compile failed; steps run eagerly)"
        if not variants:
            return "compiled decode step: not used (an expert offloaded, or attention not eligible)"
        return f"compiled decode step: {variants} variants in {seconds:.1f} s"

    def describe(self) -> str:
        """A few words for the load summary."""
        if not self.enabled:
            return "decode steps eager (the compile failed)"
        return "decode steps compiled (torch.compile, where every expert is resident)"


def _mark_dynamic(ids: torch.Tensor, step: StepContext) -> None:
    """Mark the context dims of the step's block tables and mask symbolic, and with several
    sequences the batch dim of its per-sequence tensors, so one compile serves every length and
    batch size (left to itself the compiler specialises on the first size and recompiles at the
    second). A batch of one keeps its own graph: the compiler specialises sizes of 1 anyway."""
    mark = torch._dynamo.maybe_mark_dynamic  # noqa: SLF001  (the public API's non-raising form)
    several = ids.shape[0] > 1
    for t in (ids, step.positions, *step.slots) if several else ():
        mark(t, 0)
    for t in step.tables:
        if several:
            mark(t, 0)
        mark(t, 1)
    if step.decode_mask is not None:
        if several:
            mark(step.decode_mask, 0)
        mark(step.decode_mask, 3)
