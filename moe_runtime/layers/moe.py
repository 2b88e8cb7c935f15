"""The MoE block: router, top-k, tracing/prefetch hooks, experts from the buffer, shared expert.

NOTE: one device->host sync per MoE layer, except a fully resident layer that runs device-routed
(CUDA; ``moe_runtime.layers.resident_experts``), whose ids reach the host at the step's end. The
router's top-k ids (``[T, k]``) are copied to the host once: the buffer must know which experts to
fetch, and the tracer and prefetch policy read them there (the tracer's router weights and the
router lookahead's scores, copied without blocking just before, arrive with it). Experts then run
from their slots, resident ones first as one batch while missing ones load (Klotski §5), then each
batch of landed ones (``moe_runtime.layers.experts``: one grouped GEMM per projection and batch, or
a per-expert loop where grouped GEMMs cannot run); each expert's output, scaled by its gate weight,
is summed per token in ascending expert order (one reduction, ``experts.sum_ranks``), so outputs
do not depend on which experts were resident (policy- and buffer-invariant).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.config import ModelConfig
from moe_runtime.engine.context import StepContext
from moe_runtime.layers.experts import ExpertFFN, run_experts, step_path
from moe_runtime.layers.resident_experts import ResidentSpans, run_resident
from moe_runtime.layers.routing import route


def moe_block(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    layer: int,
    moe_layer: int,
    cfg: ModelConfig,
    buffer: ExpertBuffer,
    step: StepContext,
    recorder: Any | None,
    prefetcher: Any | None,
    ahead: torch.Tensor | None = None,
    expert_path: str = "grouped",
    ffn: ExpertFFN | None = None,
    resident: ResidentSpans | None = None,
) -> torch.Tensor:
    """Apply MoE layer ``moe_layer`` (decoder layer ``layer``) to ``x [T, H]``; returns ``[T, H]``.

    ``ahead [D, E]``: the router lookahead's scores of the next D MoE layers, if the prefetch policy
    uses them (``moe_runtime.layers.router_lookahead``); handed to ``prefetcher.observe_lookahead``.
    ``expert_path``: ``grouped`` or ``loop`` (``moe_runtime.layers.experts.select_expert_path``);
    steps of few tokens run the ``few`` path instead (``moe_runtime.layers.experts.step_path``).
    ``ffn``: the experts' biases and activation when they are not the plain SwiGLU (gpt-oss).
    ``resident``: the fully resident layers' slot views where they run device-routed
    (``moe_runtime.layers.resident_experts``: no host sync; the host's per-layer work waits for the
    step's end, ``StepContext.device_routed``), or None.
    """
    p = f"layers.{layer}."
    weights, ids = route(x, w[p + "router"], cfg, w.get(p + "router_bias"), w.get(p + "router_logit_bias"))
    views = None if resident is None or ahead is not None else resident.views[moe_layer]
    if views is not None:
        out = run_resident(x, weights, ids, views, resident.experts, ffn)  # type: ignore[union-attr]
        step.device_routed.append((moe_layer, ids, weights))
        return _shared(out, x, w, p, cfg)
    num_experts = cfg.num_experts
    if prefetcher is None:
        ahead = None
    # the router weights go to the host only for a recorder that keeps them (trace files)
    keep_weights = recorder is not None and getattr(recorder, "needs_weights", True)
    ids_host, weights_host, ahead_host = _to_host(ids, weights if keep_weights else None, ahead)
    if recorder is not None:
        recorder.record(
            moe_layer, step.request_ids, step.token_seq, step.token_prefill, ids_host, weights_host
        )
    if step.observe:
        buffer.after_routing(moe_layer, step.request_ids, ids_host)
    counts = np.bincount(ids_host.reshape(-1), minlength=num_experts)
    needed = np.flatnonzero(counts).tolist()
    # This layer's misses go to the I/O queue (and its hits are pinned) before the prefetch
    # policy plans later layers: the demand copies overlap the planning. With hybrid execution
    # the buffer's placer first sends some misses to the CPU (moe_runtime.hybrid).
    run = buffer.start_layer(moe_layer, needed, counts)
    try:
        plan = None
        if prefetcher is not None and (moe_layer == 0 or not prefetcher.idle):

            def plan() -> None:
                if ahead_host is not None:
                    prefetcher.observe_lookahead(moe_layer, ahead_host)
                prefetcher.after_routing(moe_layer, step.request_ids, ids_host)

            if not plan_after_launch(x.device):
                plan()
                plan = None
        path = step_path(expert_path, x.device, x.shape[0])
        out, hit, blocked = run_experts(x, weights, ids_host, run, num_experts, path, ffn, launched=plan)
    finally:
        run.close()
    # per-request figures: reduced at the step's end (hybrid: also the CPU-placed experts' mask
    # and seconds, moe_runtime.engine.context.StepContext.cpu_attribution)
    cpu = getattr(run, "cpu", None)
    step.moe_layers.append(
        (ids_host, hit, blocked) if cpu is None else (ids_host, hit, blocked, *cpu.mask(num_experts))
    )
    return _shared(out, x, w, p, cfg)


def _shared(out: torch.Tensor, x: torch.Tensor, w: dict, p: str, cfg: ModelConfig) -> torch.Tensor:
    """``out`` plus the layer's shared expert of ``x``, if the model has one."""
    if cfg.shared_expert_intermediate_size:
        shared = F.linear(
            F.silu(F.linear(x, w[p + "shared_gate_proj"])) * F.linear(x, w[p + "shared_up"]),
            w[p + "shared_down"],
        )
        if cfg.shared_expert_gate:  # Qwen2-MoE; DeepSeek's shared experts are ungated
            shared = torch.sigmoid(F.linear(x, w[p + "shared_gate"])) * shared
        out = out + shared
    return out


def plan_after_launch(device: torch.device) -> bool:
    """Whether the prefetch policy plans after the layer's resident experts were issued (an
    accelerator computes them while the host plans: planning off the critical path)
    rather than before computing them (the CPU, which computes as it issues: planning first puts
    the plan's copies on the link sooner). Either way the plan comes before the first wait for a
    missing expert, and the outputs are the same."""
    return device.type != "cpu"


def _to_host(
    ids: torch.Tensor, weights: torch.Tensor | None, ahead: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The layer's one device->host synchronisation: ids ``[T, k]`` (int64), and when given the
    router weights ``[T, k]`` and lookahead scores ``[D, E]`` as fp32.

    On an accelerator the weights and scores are copied first, without blocking, into pinned
    host memory (``non_blocking`` D2H), then the ids with the one blocking copy: on the same
    stream it completes after them, so all three are on the host when it returns. On the CPU
    they are the tensors' own memory. Packing the three into one fp32 copy instead cost two more
    ops (a cast and a concatenation) and a cast back: 8 us more than the ids alone at batch 16
    on this 2-core host, where the scores' view adds under 1 us."""
    extra = [None if t is None else start_host_copy(t) for t in (weights, ahead)]
    ids_host = ids.cpu().numpy()
    weights_host, ahead_host = (None if t is None else t.numpy() for t in extra)
    return ids_host, weights_host, ahead_host


def start_host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as fp32 on the host: a non-blocking copy into pinned memory from an accelerator (to be
    read only after a later blocking copy on the same stream), ``t`` itself on the CPU."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_cpu else t.to("cpu", non_blocking=True)
