"""Routed experts of a fully resident MoE layer with no host decision: the device-routed path.

When the buffer holds every expert (``ExpertBuffer.all_resident``) nothing the host decides per
layer changes what is computed: no copy, no eviction, no policy. Such a layer's experts sit in one
partition's slots ``base .. base + E - 1`` in expert order (:class:`ResidentSpans`), so one grouped
GEMM per projection over those ``E`` slots computes it, with the group sizes found on the device:

* ``ids.sort(dim=1)`` puts each token's ranks in ascending expert order (the order of the
  contributions' sum), ``gather`` takes the router weights along;
* the flattened rows sorted by expert (a stable sort: by (token, rank) within an expert, the
  host-planned grouped path's order) and ``searchsorted`` of the experts ``0 .. E - 1`` give the
  groups' ends (``offs``, int32);
* one token's rows are already in that order: its rows are ``x`` repeated ``k`` times and the
  output is the contributions tensor as it is.

So the layer needs no host sync: its ids go to the host once per step, for every such layer
together (:func:`finish_step`), where the buffer's counters, the tracer and the step's per-request
figures get them as the host-planned path hands them over per layer. On a GPU this removes the
per-layer wait for the router (the host runs ahead of the device for the whole step) and the
host's index work and uploads. The arithmetic is the host-planned grouped path's row for row (same
rows in the same order, same scaling and sum), so the logits are the same bits
(``tests/test_resident_experts.py``).

Where: CUDA (:data:`DEVICE_ROUTED`), with the grouped expert path, at most ``MAX_GROUPS`` experts
per layer, no hybrid CPU experts, and a prefetch policy that plans nothing (every expert resident
means ``on-demand``). The CPU keeps the host-planned paths in eager steps: its grouped kernel loops
over every group (``~0.8 us`` per empty one), and its few-token path is cheaper there. Its compiled
decode steps (``moe_runtime.engine.compiled_decode``) route on the device too, with each row's
expert indexed from the slots (:func:`_gathered`) instead of a grouped GEMM.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moe_runtime.layers.expert_ffn import ExpertFFN, _biased, _hidden
from moe_runtime.layers.experts import MAX_GROUPS, sum_ranks

#: device type -> whether fully resident layers run device-routed (tests set the CPU's to True to
#: run the GPU's op stream)
DEVICE_ROUTED: dict[str, bool] = {"cuda": True, "cpu": False}


class ResidentSpans:
    """Per MoE layer, the ``(gate_up_t [E, H, 2I], down_t [E, I, H])`` slot views of its experts
    when they sit in slots ``base .. base + E - 1`` of one partition in expert order, else None;
    and the experts ``0 .. E - 1`` (int64, on the device) that ``searchsorted`` looks up."""

    def __init__(self, buffer: Any, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        handles = getattr(buffer, "_resident_handles", [])
        for layer in range(num_layers):
            mine = handles[layer * num_experts : (layer + 1) * num_experts]
            ok = (
                len(mine) == num_experts
                and num_experts <= MAX_GROUPS
                and all(h.part is mine[0].part for h in mine)
                and all(h.slot == mine[0].slot + e for e, h in enumerate(mine))
                and isinstance(mine[0].part.gate_up_t, torch.Tensor)  # not dequantizing slots
                and mine[0].part.device == device
            )
            if ok:
                part, base = mine[0].part, mine[0].slot
                self.views.append(
                    (part.gate_up_t[base : base + num_experts], part.down_t[base : base + num_experts])
                )
            else:
                self.views.append(None)
        self.experts = torch.arange(num_experts, device=device)


def resident_spans(
    buffer: Any, num_layers: int, num_experts: int, device: torch.device, expert_path: str
) -> ResidentSpans | None:
    """:class:`ResidentSpans` where the device-routed path may run (module docstring), else None:
    on a device of :data:`DEVICE_ROUTED` with the grouped expert path, or on the CPU for its
    compiled decode steps (``moe_runtime.engine.compiled_decode``), which route every step."""
    routed = DEVICE_ROUTED.get(device.type, False) and expert_path == "grouped"
    if not (routed or device.type == "cpu"):
        return None
    if not getattr(buffer, "all_resident", False) or getattr(buffer, "placer", None) is not None:
        return None
    spans = ResidentSpans(buffer, num_layers, num_experts, device)
    return spans if any(v is not None for v in spans.views) else None


def run_resident(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    views: tuple[torch.Tensor, torch.Tensor],
    experts: torch.Tensor,
    ffn: ExpertFFN | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` for ``x [T, H]``, router ``weights`` and ``ids``
    ``[T, k]`` (on the device), all from the layer's slot ``views``; no host sync."""
    t, k = ids.shape
    ids_s, perm = ids.sort(dim=1)  # each token's ranks in ascending expert order
    w_s = weights.gather(1, perm)
    flat = ids_s.view(-1)  # [T*k] (token, rank) rows
    if x.device.type == "cpu" and not DEVICE_ROUTED["cpu"]:  # a compiled step (tests: the GPU's ops)
        return _gathered(x, w_s, flat, views, ffn, k)
    if t == 1:  # already sorted by expert
        order, rows = None, flat
        xs = x.repeat(k, 1)
        w_rows = w_s.view(k, 1)
    else:
        rows, order = flat.sort(stable=True)  # by expert, then (token, rank)
        xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        w_rows = w_s.view(-1).index_select(0, order).unsqueeze(1)
    offs = torch.searchsorted(rows, experts, right=True, out_int32=True)  # [E] group ends
    gu_bias = down_bias = None
    if ffn is not None:
        gu_bias, down_bias = ffn.rows(rows, x.device)
    gate_up_t, down_t = views
    hidden = _hidden(torch.nn.functional.grouped_mm(xs, gate_up_t, offs=offs), ffn, gu_bias)
    y = _biased(torch.nn.functional.grouped_mm(hidden, down_t, offs=offs), down_bias)
    y = y * w_rows  # scaled by the router weight, then cast, as the reference does
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if order is not None:
        y = y.new_empty(y.shape).index_copy_(0, order, y)  # (token, rank) rows
    return sum_ranks(y, t)


def _gathered(
    x: torch.Tensor,
    w_s: torch.Tensor,
    flat: torch.Tensor,
    views: tuple[torch.Tensor, torch.Tensor],
    ffn: ExpertFFN | None,
    k: int,
) -> torch.Tensor:
    """:func:`run_resident` in a CPU compiled decode step: each (token, rank) row's expert indexed
    from the slot views (``views[0][flat]``, a copy of the ``T*k`` experts' weights), then one
    batched matmul per projection. At decode sizes of small models the copy is cheap; the CPU's
    grouped GEMM would run one call per expert, used or not, and the compiler does not take it in
    fp32. ``w_s``: the router weights ``[T, k]`` in the ranks' sorted order; ``flat``: ``[T*k]``
    the rows' experts."""
    gate_up_t, down_t = views
    t = x.shape[0]
    xs = x.unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, 1, x.shape[1])  # [T*k, 1, H]
    gu_bias = down_bias = None
    if ffn is not None:
        gu_bias, down_bias = ffn.rows(flat, x.device)
    hidden = _hidden(torch.bmm(xs, gate_up_t[flat]).squeeze(1), ffn, gu_bias)  # [T*k, I]
    y = _biased(torch.bmm(hidden.unsqueeze(1), down_t[flat]).squeeze(1), down_bias)
    y = y * w_s.reshape(-1, 1)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return sum_ranks(y, t)


def finish_step(
    pending: list[tuple[int, torch.Tensor, torch.Tensor]],
    buffer: Any,
    step: Any,
    recorder: Any | None,
    num_experts: int,
) -> None:
    """The host's per-layer work of the step's device-routed layers, in layer order, from one
    device->host copy: the buffer's lookups and hits (``start_layer`` of the used experts), the
    tracer's record and the cache policy's view of the routing, and the step's per-layer entry
    (``StepContext.moe_layers``: every used expert a hit, nothing blocked).

    ``pending``: ``(moe layer, ids [T, k], weights [T, k])`` per such layer, on the device."""
    if not pending:
        return
    keep_weights = recorder is not None and getattr(recorder, "needs_weights", True)
    ids_host = torch.stack([p[1] for p in pending]).cpu().numpy()  # [L', T, k], the step's one sync
    weights_host = None
    if keep_weights:
        weights_host = torch.stack([p[2] for p in pending]).float().cpu().numpy()
    for i, (moe_layer, _, _) in enumerate(pending):
        ids_l = ids_host[i]
        if recorder is not None:
            recorder.record(
                moe_layer,
                step.request_ids,
                step.token_seq,
                step.token_prefill,
                ids_l,
                None if weights_host is None else weights_host[i],
            )
        if step.observe:
            buffer.after_routing(moe_layer, step.request_ids, ids_l)
        counts = np.bincount(ids_l.reshape(-1), minlength=num_experts)
        needed = np.flatnonzero(counts)
        buffer.start_layer(moe_layer, needed.tolist(), counts).close()  # counted as resident hits
        hit = np.zeros(num_experts, dtype=bool)
        hit[needed] = True
        step.moe_layers.append((ids_l, hit, np.zeros(num_experts, dtype=np.float64)))
    pending.clear()
