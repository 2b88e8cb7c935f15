"""The MoE block: router, top-k, tracing/prefetch hooks, experts from the buffer, shared expert.

NOTE: one device->host sync per MoE layer. The router's top-k ids (``[T, k]``) are copied to the
host once: the buffer must know which experts to fetch, and the tracer and prefetch policy read
them there. Experts then run grouped (all tokens of one expert in one pair of matmuls), resident
ones first while missing ones load (Klotski §5); each expert's output, scaled by its gate weight, is
summed per token in ascending expert order, exactly as the reference's ``index_add_`` loop
does, so outputs do not depend on which experts were resident (policy- and buffer-invariant).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.config import ModelConfig
from moe_runtime.engine.context import StepContext


def route(x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing. ``x [T, H]`` -> (weights ``[T, k]``, expert ids ``[T, k]``)."""
    probs = F.softmax(F.linear(x, router).float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.router_weights_in_model_dtype:
        weights = weights.to(x.dtype)
    return weights, ids


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
) -> torch.Tensor:
    """Apply MoE layer ``moe_layer`` (decoder layer ``layer``) to ``x [T, H]``; returns ``[T, H]``.

    ``ahead [D, E]``: the router lookahead's scores of the next D MoE layers, if the prefetch policy
    uses them (``moe_runtime.layers.router_lookahead``); handed to ``prefetcher.observe_lookahead``.
    """
    p = f"layers.{layer}."
    weights, ids = route(x, w[p + "router"], cfg)
    k, num_experts = cfg.top_k, cfg.num_experts
    ids_host = ids.cpu().numpy()  # the one sync of this layer
    if recorder is not None:
        recorder.record(
            moe_layer,
            step.request_ids,
            step.token_seq,
            step.token_prefill,
            ids_host,
            weights.float().cpu().numpy(),
        )
    if step.observe:
        buffer.after_routing(moe_layer, step.request_ids, ids_host)
    flat_host = np.sort(ids_host, axis=1).reshape(-1)
    counts = np.bincount(flat_host, minlength=num_experts)
    needed = np.flatnonzero(counts).tolist()
    # This layer's misses go to the I/O queue (and its hits are pinned) before the prefetch
    # policy plans later layers: the demand copies overlap the planning.
    run = buffer.start_layer(moe_layer, needed)
    try:
        if prefetcher is not None:
            if ahead is not None:
                prefetcher.observe_lookahead(moe_layer, ahead.cpu().numpy())  # ready: ids synced
            prefetcher.after_routing(moe_layer, step.request_ids, ids_host)
        out, hit, blocked = _run_experts(x, ids, weights, k, flat_host, counts, run, num_experts)
    finally:
        run.close()
    _attribute(step, ids_host, hit, blocked, num_experts)
    if cfg.shared_expert_intermediate_size:
        shared = F.linear(
            F.silu(F.linear(x, w[p + "shared_gate_proj"])) * F.linear(x, w[p + "shared_up"]),
            w[p + "shared_down"],
        )
        out = out + torch.sigmoid(F.linear(x, w[p + "shared_gate"])) * shared
    return out


def _run_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    flat_host: np.ndarray,
    counts: np.ndarray,
    run: Any,
    num_experts: int,
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Run each expert of ``run`` on its tokens; returns (``out [T, H]``, hit ``[E]``, blocked s ``[E]``).

    ``flat_host [T*k]``: each token's expert ids sorted, flattened; ``counts [E]``: their bincount.
    """
    # Sort each token's k choices by expert id so the final sum adds contributions in ascending
    # expert order, as the reference's per-expert index_add_ does, whatever order experts ran in.
    sorted_ids, perm = ids.sort(dim=-1)  # [T, k]
    w_flat = weights.gather(1, perm).reshape(-1)  # [T*k]
    offsets = np.concatenate(([0], np.cumsum(counts)))
    order = torch.argsort(sorted_ids.reshape(-1), stable=True)  # [T*k] flat positions grouped by expert
    xs_sorted = x[order // k]  # [T*k, H] token rows grouped by expert (one gather for the layer)
    w_sorted = w_flat[order, None]  # [T*k, 1]
    y_sorted = torch.empty_like(xs_sorted)  # [T*k, H] expert outputs, same grouping
    hit = np.zeros(num_experts, dtype=bool)
    blocked = np.zeros(num_experts, dtype=np.float64)
    for h in run:
        e = h.expert
        a, b = offsets[e], offsets[e + 1]  # rows of xs_sorted routed to e
        xs = xs_sorted[a:b]
        if h.device != x.device:
            xs = xs.to(h.device)
        gate, up = F.linear(xs, h.gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, h.down)
        if h.device != x.device:
            y = y.to(x.device)
        y_sorted[a:b] = y * w_sorted[a:b]
        hit[e], blocked[e] = h.hit, h.blocked_s
    contrib = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)  # back to (token, rank) order
    contrib = contrib.view(-1, k, x.shape[1])
    out = contrib[:, 0]
    for j in range(1, k):
        out = out + contrib[:, j]
    return out, hit, blocked


def _attribute(
    step: StepContext, ids_host: np.ndarray, hit: np.ndarray, blocked: np.ndarray, num_experts: int
) -> None:
    """Charge each sequence the lookups, hits and blocking of the experts its tokens used."""
    use = np.zeros((step.num_seqs, num_experts), dtype=bool)
    use[step.token_seq[:, None], ids_host] = True
    step.seq_lookups += use.sum(axis=1)
    step.seq_hits += use[:, hit].sum(axis=1)
    if blocked.any():
        step.seq_blocking_s += use @ blocked
