"""Routed experts of one MoE layer computed from the slot buffer: grouped GEMMs or a per-expert loop.

NOTE: the grouped path (issue 14). A batch of experts (the resident set, or experts that landed
together) runs as ONE ``torch.nn.functional.grouped_mm`` per projection over the partition's slot
views ``gate_up_t [S, H, 2I]`` and ``down_t [S, I, H]``, with the batch's token rows sorted by slot
and ``offs`` ending each slot's group (slots the batch does not use get empty groups). All index
work is done on the host from the router ids the layer already synced: per batch one small
host->device copy of indices, no further sync. CUDA's grouped kernel takes at most
:data:`MAX_GROUPS` groups, so a batch spanning more slots runs one call per segment of slots.
The ``loop`` path runs the same batches with two ``F.linear`` per expert (the fallback where
``grouped_mm`` cannot run: dtype, CUDA architecture).

Determinism: a token's expert contributions land in ``contrib [T*k, H]`` at (token, rank) with the
ranks sorted by expert id; the final sum adds rank 0, 1, ... in that order, as the reference's
ascending ``index_add_`` loop does, whatever batches the experts ran in. Each expert's rows are
computed as ``F.linear`` would (checked at load by :func:`select_expert_path`), so outputs do not
depend on the path, the buffer size or the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MAX_GROUPS = 1024  # CUDA grouped_mm: "Can't process more than 1024 groups"
PATHS = ("grouped", "loop")


def select_expert_path(device: torch.device, dtype: torch.dtype) -> str:
    """``grouped`` if ``grouped_mm`` runs on ``device``/``dtype`` over strided slot views and gives
    exactly ``F.linear``'s result per expert on a tiny probe, else ``loop``. Called once at load."""
    if not hasattr(F, "grouped_mm"):
        return "loop"
    hidden, inter, slots = 32, 16, 3
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(slots, 3 * inter * hidden, generator=gen).to(device=device, dtype=dtype)
    w = flat[:, : 2 * inter * hidden].unflatten(1, (2 * inter, hidden))  # as Partition.gate_up_all
    x = torch.randn(5, hidden, generator=gen).to(device=device, dtype=dtype)
    counts = [2, 0, 3]
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)
    try:
        got = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return "loop"
    want = torch.cat([F.linear(x[0:2], w[0]), F.linear(x[2:5], w[2])])
    return "grouped" if torch.equal(got, want) else "loop"


class LayerPlan:
    """Host-side index work of one MoE layer, from the router's ids.

    Args:
        ids_host: ``[T, k]`` expert ids (the layer's one sync). num_experts: E.

    Attributes:
        expert: ``[T*k]`` expert of each (token, rank) with ranks sorted by expert id.
        weight_src: ``[T*k]`` index into the flattened router weights ``[T*k]`` of that choice.
    """

    def __init__(self, ids_host: np.ndarray, num_experts: int) -> None:
        t, k = ids_host.shape
        self.num_experts = num_experts
        perm = np.argsort(ids_host, axis=1, kind="stable")
        self.k = k
        self.expert = np.take_along_axis(ids_host, perm, axis=1).reshape(-1)
        self.weight_src = (perm + np.arange(t)[:, None] * k).reshape(-1)

    def segments(self, batch: list[Any]) -> Iterable[tuple[Any, np.ndarray, int, np.ndarray]]:
        """Split a batch of :class:`~moe_runtime.buffer.ExpertHandle` into grouped calls:
        ``(partition, positions, first slot, counts)`` with ``positions`` the (token, rank)
        indices sorted by slot and ``counts [n_slots]`` rows per slot from ``first slot`` on
        (at most :data:`MAX_GROUPS` slots per call)."""
        by_part: dict[int, tuple[Any, list[int], list[int]]] = {}
        for h in batch:
            part, experts, slots = by_part.setdefault(id(h.part), (h.part, [], []))
            experts.append(h.expert)
            slots.append(h.slot)
        for part, experts, slots in by_part.values():
            slot_of = np.full(self.num_experts, -1, dtype=np.int64)
            slot_of[experts] = slots
            row_slot = slot_of[self.expert]
            pos = np.flatnonzero(row_slot >= 0)
            order = np.argsort(row_slot[pos], kind="stable")
            pos, row_slot = pos[order], row_slot[pos][order]
            lo, hi = int(row_slot[0]), int(row_slot[-1]) + 1
            for first in range(lo, hi, MAX_GROUPS):
                last = min(first + MAX_GROUPS, hi)
                a, b = np.searchsorted(row_slot, [first, last])
                if a == b:
                    continue
                counts = np.bincount(row_slot[a:b] - first, minlength=last - first)
                yield part, pos[a:b], first, counts


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids_host: np.ndarray,
    run: Any,
    num_experts: int,
    path: str,
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The routed experts' output for ``x [T, H]``.

    Args:
        weights: ``[T, k]`` router weights of ``ids_host [T, k]`` (same order).
        run: the layer run (:meth:`ExpertBuffer.start_layer`); its ``batches()`` are consumed.
        path: ``grouped`` or ``loop`` (:func:`select_expert_path`).

    Returns:
        (``out [T, H]``, hit ``[E]`` bool, blocked seconds ``[E]``).
    """
    plan = LayerPlan(ids_host, num_experts)
    t, k = ids_host.shape
    w_flat = weights.reshape(-1)
    contrib = torch.empty((t * k, x.shape[1]), dtype=x.dtype, device=x.device)  # (token, rank) rows
    hit = np.zeros(num_experts, dtype=bool)
    blocked = np.zeros(num_experts, dtype=np.float64)
    for batch in run.batches():
        for h in batch:
            hit[h.expert], blocked[h.expert] = h.hit, h.blocked_s
        for part, pos, first, counts in plan.segments(batch):
            idx = np.stack([pos // k, plan.weight_src[pos], pos])  # [3, n]: token, weight, row
            idx = torch.from_numpy(idx).to(x.device, non_blocking=True)  # one upload, no sync
            xs = x.index_select(0, idx[0])  # [n, H] token rows sorted by slot
            if part.device != x.device:
                xs = xs.to(part.device)
            if path == "grouped":
                y = _grouped(xs, part, first, counts)
            else:
                y = _loop(xs, part, first, counts)
            if part.device != x.device:
                y = y.to(x.device)
            y = (y * w_flat.index_select(0, idx[1]).unsqueeze(1)).to(contrib.dtype)  # as the reference
            contrib.index_copy_(0, idx[2], y)
    # contributions summed per token in ascending expert order (ranks were sorted by expert id)
    c = contrib.view(t, k, -1)
    out = c[:, 0]
    for j in range(1, k):
        out = out + c[:, j]
    return out, hit, blocked


def _grouped(xs: torch.Tensor, part: Any, first: int, counts: np.ndarray) -> torch.Tensor:
    """Both projections of the experts in slots ``first ..`` as one grouped GEMM each."""
    offs = torch.from_numpy(np.cumsum(counts, dtype=np.int32)).to(xs.device, non_blocking=True)
    last = first + len(counts)
    gate, up = F.grouped_mm(xs, part.gate_up_t[first:last], offs=offs).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, part.down_t[first:last], offs=offs)


def _loop(xs: torch.Tensor, part: Any, first: int, counts: np.ndarray) -> torch.Tensor:
    """The same rows, two ``F.linear`` per used slot (the fallback path)."""
    y = torch.empty_like(xs)
    a = 0
    for s in np.flatnonzero(counts).tolist():
        b = a + int(counts[s])
        gate, up = F.linear(xs[a:b], part.gate_up[first + s]).chunk(2, dim=-1)
        y[a:b] = F.linear(F.silu(gate) * up, part.down[first + s])
        a = b
    return y
