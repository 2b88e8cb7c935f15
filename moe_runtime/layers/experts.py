"""Routed experts of one MoE layer computed from the slot buffer: grouped GEMMs or a per-expert loop.

NOTE: the grouped path. A batch of experts (the resident set, or experts that landed
together) runs as ONE ``torch.nn.functional.grouped_mm`` per projection over the partition's slot
views ``gate_up_t [S, H, 2I]`` and ``down_t [S, I, H]``, with the batch's token rows sorted by slot
and ``offs`` ending each slot's group (slots the batch does not use get empty groups). All index
work is done on the host from the router ids the layer already synced: per batch one small
host->device copy of indices, no further sync. CUDA's grouped kernel takes at most
:data:`MAX_GROUPS` groups, so a batch spanning more slots runs one call per segment of slots.
The ``loop`` path runs the same batches with two ``F.linear`` per expert (the fallback where
``grouped_mm`` cannot run: dtype, CUDA architecture). Steps of at most :data:`FEW_TOKENS` tokens
(decode of one to a few sequences; CPU only) take the ``few`` path instead: each expert's two
``F.linear`` on its own rows, a slice of ``x`` for a single token, with none of the grouped call's
host index work, which at a handful of rows costs more than it saves. A batch of ONE expert (the
usual miss on a slow link: each lands alone while the previous one computes) runs its two
``F.linear`` on rows taken from one upload per layer of every row's indices grouped by expert
(:meth:`LayerPlan.expert_rows`), skipping the batch's sort, offsets and upload: 36.5 -> 25.2 us
of host time per such batch at the bundled model's shape (thread CPU time, batch 4, median of 7).
The layer's token rows and router weights are gathered in that order once too, at its first
one-expert batch (:meth:`LayerPlan.expert_inputs`), so each further one is ten aten ops (three
slices, the two projections, SwiGLU, the weight scale, one ``index_copy_``) instead of fifteen:
34-36 -> 26 us per one-expert batch, setup included (thread CPU time, a 15-expert layer of the
bundled model's shape at batch 4 in one-expert batches, old and new interleaved, median of 350,
two runs; ``tests/test_experts.py`` pins the op count).

Determinism: a token's expert contributions land in ``contrib [T*k, H]`` at (token, rank) with the
ranks sorted by expert id; one reduction over the ranks sums them (:func:`sum_ranks`: in fp32 on
the CPU the reference's ascending ``index_add_`` order bit for bit), whatever batches the experts
ran in. Each expert's rows are
computed as ``F.linear`` would (checked at load by :func:`select_expert_path`), so outputs do not
depend on the path, the buffer size or the policy.

gpt-oss's experts (:class:`ExpertFFN`) add a bias per expert to each projection and use another
activation; the biases are small resident tensors of the MoE layer (``[E, 2I]``, ``[E, H]``), not
part of the slots, gathered per row by expert id (one more index in the grouped path's upload).
Without an :class:`ExpertFFN` every path runs exactly the ops it ran before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# re-exported: the hybrid executor and tests import them from here
from moe_runtime.layers.expert_ffn import ExpertFFN, RowBias, _biased, _hidden  # noqa: F401

MAX_GROUPS = 1024  # CUDA grouped_mm: "Can't process more than 1024 groups"
# Unused slots one grouped call may span between two used ones, per device type. CUDA: any (an
# empty group costs the kernel next to nothing; a call costs launches). CPU: grouped_mm loops over
# every group in C++ (~0.8 µs per empty one and call, so ~1.6 µs per unused slot for the two
# projections; fp32, bundled shape), and ~9 ops of an extra call cost about what 8 unused slots
# do, so a longer run of unused slots starts a new call. It matters below 100% buffers, where a
# batch's experts sit in scattered slots (16 was measurably slower there at batch 8).
MAX_GAP = {"cuda": MAX_GROUPS, "cpu": 8}
# Steps of at most this many tokens run each expert as two ``F.linear`` straight on its slot views
# (:func:`_few_tokens`: no sort, no offsets, index tensors only for experts several tokens chose),
# per device type. CPU: 3, chosen on whole decode steps of the bundled model (thread CPU time of
# the MoE blocks at batch 1, 2, 3, 4 and 8 with each threshold: few wins up to 3, ties at 4, loses
# at 8); one isolated layer with random routing (``moeserve bench experts``: ``few µs`` against
# ``grouped µs``) puts the crossover at 2-3 tokens. CUDA: 0, the grouped call's two launches beat
# two matmuls' launches per expert.
FEW_TOKENS = {"cpu": 3, "cuda": 0}
Segment = tuple[int, int, int]  # (first slot, slot count, first row) of one grouped call


def select_expert_path(
    device: torch.device, dtype: torch.dtype, hidden: int | None = None, intermediate: int | None = None
) -> str:
    """``grouped`` if ``grouped_mm`` runs on ``device``/``dtype`` over strided slot views and gives
    exactly ``F.linear``'s result per expert on a tiny probe, else ``loop``. Called once at load.

    On CUDA the grouped kernel needs 16-byte aligned rows and slot starts: with the model's
    ``hidden`` (H) or ``intermediate`` (I) width not a multiple of ``16 / element size`` (8 in
    bf16), the path is ``loop``. And it must not synchronise: where PyTorch has no grouped kernel
    for the device and dtype (bf16 on sm90/sm100 in recent releases) its fallback copies the
    offsets to the host and runs one matmul per group, a host sync per call that also breaks CUDA
    graph capture; the probe runs under ``torch.cuda.set_sync_debug_mode("error")`` and such a
    device gets ``loop``, the same matmuls without the sync."""
    if not hasattr(F, "grouped_mm"):
        return "loop"
    align = 16 // torch.empty(0, dtype=dtype).element_size()
    if device.type == "cuda" and any(d is not None and d % align for d in (hidden, intermediate)):
        return "loop"
    hidden, inter, slots = 32, 16, 3
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(slots, 3 * inter * hidden, generator=gen).to(device=device, dtype=dtype)
    w = flat[:, : 2 * inter * hidden].unflatten(1, (2 * inter, hidden))  # as Partition.gate_up_all
    x = torch.randn(5, hidden, generator=gen).to(device=device, dtype=dtype)
    counts = [2, 0, 3]
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)
    cuda = device.type == "cuda"
    mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")  # a synchronising fallback raises here
        got = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return "loop"
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)
    want = torch.cat([F.linear(x[0:2], w[0]), F.linear(x[2:5], w[2])])
    return "grouped" if torch.equal(got, want) else "loop"


class LayerPlan:
    """Host-side index work of one MoE layer, from the router's ids.

    Args:
        ids_host: ``[T, k]`` expert ids (the layer's one sync). num_experts: E.
        max_gap: empty slots a grouped call may span between two used ones (:data:`MAX_GAP`).

    Attributes:
        expert: ``[T*k]`` expert of each (token, rank) with ranks sorted by expert id.
        weight_src: ``[T*k]`` index into the flattened router weights ``[T*k]`` of that choice.
    """

    def __init__(self, ids_host: np.ndarray, num_experts: int, max_gap: int) -> None:
        t, k = ids_host.shape
        self.max_gap = max_gap
        perm = np.argsort(ids_host, axis=1, kind="stable")
        self.expert = np.sort(ids_host, axis=1).reshape(-1)
        self.weight_src = (perm + np.arange(t)[:, None] * k).reshape(-1)
        self.counts = np.bincount(self.expert, minlength=num_experts)  # rows per expert
        self.num_used = int(np.count_nonzero(self.counts))
        self._slot_of = np.full(num_experts, -1, dtype=np.int64)
        self._k = k
        self._inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray] | None = None

    def expert_rows(self, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
        """``(rows [3, T*k] int64 on device, starts [E + 1])``: for the (token, rank) rows in
        ascending expert order, each row's token, index into the flattened router weights and
        (token, rank) position; expert ``e``'s rows are columns ``starts[e]:starts[e + 1]``, in
        ascending position (the order :meth:`calls` gives one expert's rows). One host->device
        copy, no sync; :meth:`expert_inputs` calls it once per layer."""
        pos = np.argsort(self.expert, kind="stable")  # [T*k] positions grouped by expert
        host = np.stack([pos // self._k, self.weight_src[pos], pos])
        starts = np.concatenate(([0], np.cumsum(self.counts)))
        return torch.from_numpy(host).to(device, non_blocking=True), starts

    def expert_inputs(
        self, x: torch.Tensor, w_flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
        """``(x_rows [T*k, H], w_rows [T*k, 1], positions [T*k], starts [E + 1])``: the rows of
        :meth:`expert_rows`, gathered once per layer (on the first call): each row's token of
        ``x [T, H]``, its router weight from ``w_flat [T*k]`` and its (token, rank) position.
        Expert ``e``'s inputs are then rows ``starts[e]:starts[e + 1]`` of each, one slice apiece
        (three ops per one-expert batch instead of seven: three row selects, two gathers, an
        unsqueeze and a slice)."""
        if self._inputs is None:
            rows, starts = self.expert_rows(x.device)
            tok, src, pos = rows.unbind(0)
            self._inputs = (x.index_select(0, tok), w_flat.index_select(0, src).unsqueeze(1), pos, starts)
        return self._inputs

    def calls(self, batch: list[Any]) -> Iterable[tuple[Any, np.ndarray, list[Segment], np.ndarray]]:
        """Split a batch of :class:`~moe_runtime.buffer.ExpertHandle` per partition into grouped
        calls: ``(partition, positions, segments, offs)``. ``positions [n]``: the (token, rank)
        indices of the partition's rows, sorted by slot; ``segments``: ``(first slot, slot count,
        first row)`` per grouped call, cut where the slot span would exceed :data:`MAX_GROUPS` or
        a run of unused slots ``max_gap``; ``offs [sum of slot counts]`` int32: each segment's
        group ends (relative to its first row), concatenated."""
        by_part: dict[int, list[Any]] = {}
        for h in batch:
            by_part.setdefault(id(h.part), []).append(h)
        slot_of = self._slot_of
        for handles in by_part.values():
            handles.sort(key=lambda h: h.slot)
            experts = [h.expert for h in handles]
            slots = [h.slot for h in handles]
            slot_of[experts] = slots
            row_slot = slot_of[self.expert]
            slot_of[experts] = -1
            if len(handles) == self.num_used:  # every row is in this call
                pos = np.argsort(row_slot, kind="stable")
            else:
                pos = np.flatnonzero(row_slot >= 0)
                pos = pos[np.argsort(row_slot[pos], kind="stable")]
            rows = self.counts[experts].tolist()
            segments: list[Segment] = []
            offs: list[int] = []
            i, row = 0, 0
            while i < len(slots):  # one segment per iteration: slots[i:j]
                j, first = i + 1, slots[i]
                while (
                    j < len(slots)
                    and slots[j] - slots[j - 1] <= self.max_gap + 1
                    and slots[j] < first + MAX_GROUPS
                ):
                    j += 1
                end, prev = 0, first - 1
                for slot, n in zip(slots[i:j], rows[i:j]):
                    offs.extend([end] * (slot - prev - 1))  # unused slots: empty groups
                    end += n
                    offs.append(end)
                    prev = slot
                segments.append((first, slots[j - 1] - first + 1, row))
                row += end
                i = j
            yield handles[0].part, pos, segments, np.asarray(offs, dtype=np.int32)


def launch_then(run: Any, launched: Callable[[], None] | None) -> Iterator[list[Any]]:
    """``run.batches()``, calling ``launched()`` once: when the caller comes back for the batch
    after the resident experts' one (it has issued their work by then), or at once when the run
    has no resident expert; either way before the first wait for a missing expert."""
    batches = run.batches()
    if launched is not None and not run.resident_first:
        launched()
        launched = None
    for batch in batches:
        yield batch
        if launched is not None:
            launched()
            launched = None
    if launched is not None:  # an empty run
        launched()


def step_path(load_path: str, device: torch.device, tokens: int) -> str:
    """The path a step of ``tokens`` tokens runs: ``few`` up to :data:`FEW_TOKENS` on ``device``'s
    type, else ``load_path`` (:func:`select_expert_path`'s choice at load)."""
    return "few" if tokens <= FEW_TOKENS.get(device.type, 0) else load_path


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids_host: np.ndarray,
    run: Any,
    num_experts: int,
    path: str,
    ffn: ExpertFFN | None = None,
    launched: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The routed experts' output for ``x [T, H]``.

    Args:
        weights: ``[T, k]`` router weights of ``ids_host [T, k]`` (same order).
        run: the layer run (:meth:`ExpertBuffer.start_layer`); its ``batches()`` are consumed.
        path: ``grouped`` or ``loop`` (:func:`select_expert_path`), or ``few`` (each expert on its
            own rows, no grouped index work; :func:`step_path` picks it for steps of few tokens).
        ffn: per-expert biases and activation (gpt-oss), or None.
        launched: called once, after the resident experts' batch was issued and before the first
            wait for a missing one (:func:`launch_then`): on an accelerator the host work it does
            (the prefetch plan) overlaps the device computing that batch.

    Returns:
        (``out [T, H]``, hit ``[E]`` bool, blocked seconds ``[E]``).
    """
    t, k = ids_host.shape
    cpu = getattr(run, "cpu", None)  # hybrid: the CPU-placed experts start first, beside the batches
    if cpu is not None:
        cpu.start(x, ids_host, ffn)
    if path == "few":
        return _few_tokens(x, weights, ids_host, run, num_experts, ffn, launched)
    plan = LayerPlan(ids_host, num_experts, MAX_GAP.get(x.device.type, MAX_GROUPS))
    w_flat = weights.reshape(-1)
    # (token, rank) rows: allocated at the first write, unless that write is every row in order
    # (one call whose rows sorted by slot are the (token, rank) order, e.g. one token, slots in
    # expert order): its output is then ``contrib`` itself
    contrib: torch.Tensor | None = None
    hit = np.zeros(num_experts, dtype=bool)
    blocked = np.zeros(num_experts, dtype=np.float64)
    biased = ffn is not None and (ffn.gate_up_bias is not None or ffn.down_bias is not None)
    for batch in launch_then(run, launched):
        for h in batch:
            hit[h.expert], blocked[h.expert] = h.hit, h.blocked_s
        if len(batch) == 1:  # one expert landed (the usual miss): its rows, no per-batch index work
            contrib = _rows(contrib, t * k, x)
            _one_expert(x, w_flat, batch[0], plan, contrib, ffn)
            continue
        # three passes over the batch's partitions, so that experts homed on several GPUs run at
        # once: every partition's rows go to its device before any expert runs (a copy between
        # GPUs waits for the work already queued on both), the experts, then the outputs back
        staged = []
        for part, pos, segments, offs in plan.calls(batch):
            n = len(pos)
            # uploads without a sync: token, weight and row index (and with biases the expert) of
            # each sorted row; the offs
            parts = [pos // k, plan.weight_src[pos], pos]
            host = np.concatenate([*parts, plan.expert[pos]] if biased else parts)
            dev = torch.from_numpy(host).to(x.device, non_blocking=True)
            xs = x.index_select(0, dev[:n])  # [n, H] token rows sorted by slot
            if part.device != x.device:
                xs = xs.to(part.device)
            bias = ffn.rows(dev[3 * n :], part.device) if biased else (None, None)
            staged.append((part, pos, segments, offs, dev, xs, bias))
        outs = []
        for part, _, segments, offs, _, xs, bias in staged:
            if path == "grouped":
                y = _grouped(
                    xs, part, segments, torch.from_numpy(offs).to(part.device, non_blocking=True), ffn, bias
                )
            else:
                y = _loop(xs, part, segments, offs, ffn, bias)
            outs.append(y)
        for (part, pos, _, _, dev, _, _), y in zip(staged, outs):
            n = len(pos)
            if part.device != x.device:
                y = y.to(x.device)
            # scaled by the router weight, then cast, as the reference does
            y = _cast(y * w_flat.index_select(0, dev[n : 2 * n]).unsqueeze(1), x.dtype)
            if contrib is None and n == t * k and bool((pos == np.arange(n)).all()):
                contrib = y
            else:
                contrib = _rows(contrib, t * k, x)
                contrib.index_copy_(0, dev[2 * n : 3 * n], y)
    contrib = _rows(contrib, t * k, x)
    if cpu is not None:  # their outputs, scaled and cast as above, at their (token, rank) rows
        for _, pos, y in cpu.finish(x, weights):
            contrib.index_copy_(0, pos, y)
    return sum_ranks(contrib, t), hit, blocked


def _rows(contrib: torch.Tensor | None, n: int, x: torch.Tensor) -> torch.Tensor:
    """``contrib``, or a new ``[n, H]`` tensor of ``x``'s dtype for the (token, rank) rows."""
    return contrib if contrib is not None else x.new_empty((n, x.shape[1]))


def _expert_on_rows(
    xs: torch.Tensor, h: Any, ffn: ExpertFFN | None, out_device: torch.device
) -> torch.Tensor:
    """Expert ``h`` (an :class:`ExpertHandle`) on its rows ``xs [n, H]``: two ``F.linear`` on its
    slot views, with its bias rows (``[2I]``, ``[H]``, broadcast over the rows) where ``ffn`` has
    them; ``[n, H]`` on ``out_device``. The few path and a one-expert batch share it."""
    if h.device != out_device:
        xs = xs.to(h.device)
    gu_bias = down_bias = None
    if ffn is not None:
        gu_bias, down_bias = (
            None if b is None else b[h.expert].to(h.device) for b in (ffn.gate_up_bias, ffn.down_bias)
        )
    y = _biased(F.linear(_hidden(F.linear(xs, h.gate_up), ffn, gu_bias), h.down), down_bias)
    return y if h.device == out_device else y.to(out_device)


def _one_expert(
    x: torch.Tensor,
    w_flat: torch.Tensor,
    h: Any,
    plan: LayerPlan,
    contrib: torch.Tensor,
    ffn: ExpertFFN | None,
) -> None:
    """:func:`run_experts`' work for a batch of one expert ``h`` (an :class:`ExpertHandle`):
    its rows from the layer's one upload, gathered once per layer
    (:meth:`LayerPlan.expert_inputs`), instead of a batch's sort, offsets and upload; two
    ``F.linear`` on its slot views, as the grouped path runs a one-expert segment, so the same
    bits land in ``contrib``."""
    x_rows, w_rows, positions, starts = plan.expert_inputs(x, w_flat)
    a, b = int(starts[h.expert]), int(starts[h.expert + 1])
    y = _expert_on_rows(x_rows[a:b], h, ffn, x.device)
    # scaled by the router weight, then cast, as the reference does
    y = _cast(y * w_rows[a:b], contrib.dtype)
    contrib.index_copy_(0, positions[a:b], y)


def _cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y.to(dtype)``, without the op when it already is (the same tensor either way)."""
    return y if y.dtype == dtype else y.to(dtype)


def _few_tokens(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids_host: np.ndarray,
    run: Any,
    num_experts: int,
    ffn: ExpertFFN | None = None,
    launched: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """:func:`run_experts` for a step of few tokens (``x [T, H]``, T at most
    :data:`FEW_TOKENS`): each expert as two ``F.linear`` on its slot views over its own rows, in
    the order the run hands them out. A row of one token is a slice of ``x``; only an expert that
    several tokens chose gathers its rows (one small index tensor). The rows are scaled by their
    router weights in one multiply at the end (row for row the other paths' products; hybrid CPU
    experts come back scaled, so then each row is scaled as it lands), then summed per token in
    ascending expert order as the other paths do."""
    t, k = ids_host.shape
    cols = np.argsort(ids_host, axis=1, kind="stable")  # [T, k] weight column of each rank
    # expert -> its (token, (token, rank) position) rows, ranks sorted by expert
    rows: dict[int, list[tuple[int, int]]] = {}
    for tok, (ids_row, order) in enumerate(zip(ids_host.tolist(), cols.tolist())):
        for rank, col in enumerate(order):
            rows.setdefault(ids_row[col], []).append((tok, tok * k + rank))
    src = (cols + np.arange(t)[:, None] * k).reshape(-1)  # flat weight index of each position
    cpu = getattr(run, "cpu", None)
    late = cpu is None
    pieces: list[Any] = [None] * (t * k)  # output row [1, H] per (token, rank)
    x_rows = (x,) if t == 1 else x.split(1)  # [1, H] views, one op
    w_col = weights.reshape(-1, 1)  # [T*k, 1]
    hit = np.zeros(num_experts, dtype=bool)
    blocked = np.zeros(num_experts, dtype=np.float64)
    for batch in launch_then(run, launched):
        for h in batch:
            e = h.expert
            hit[e], blocked[e] = h.hit, h.blocked_s
            mine = rows[e]
            pos = [p for _, p in mine]
            if len(mine) == 1:
                xs = x_rows[mine[0][0]]
            else:
                xs = x.index_select(0, torch.tensor([tok for tok, _ in mine], device=x.device))
            y = _expert_on_rows(xs, h, ffn, x.device)
            if not late:  # scaled and cast now, as the hybrid rows are
                y = _cast(y * w_col.index_select(0, torch.tensor(src[pos], device=x.device)), x.dtype)
            for i, p in enumerate(pos):
                pieces[p] = y if len(pos) == 1 else y[i : i + 1]
    if cpu is not None:  # hybrid: the CPU-placed experts' outputs, scaled and cast as above
        for pos_t, _, y in cpu.finish(x, weights):
            for i, p in enumerate(pos_t.tolist()):
                pieces[p] = y if len(pos_t) == 1 else y[i : i + 1]
    contrib = torch.cat(pieces)  # [T*k, H] in (token, rank) order
    if late:  # scaled by the router weights, then cast, as the reference does
        idx = torch.from_numpy(src)
        w = w_col.index_select(0, idx if x.device.type == "cpu" else idx.to(x.device))
        contrib = _cast(contrib * w, x.dtype)
    return sum_ranks(contrib, t), hit, blocked


def sum_ranks(contrib: torch.Tensor, t: int) -> torch.Tensor:
    """Each token's expert contributions summed: ``contrib [T*k, H]`` in (token, rank) order,
    ranks in ascending expert order -> ``[T, H]``. One reduction for every path (grouped, loop,
    few, the CPU's hybrid experts, the device-routed one), so they all give the same bits whichever
    experts were resident (one token: over dim 0 of ``[k, H]``, the same reduction without a view).
    In fp32 on the CPU it equals the reference's left-to-right adds bit for bit; in bf16 it
    accumulates in fp32 and rounds once (the reference rounds after each add)."""
    if t == 1:
        return contrib.sum(dim=0, keepdim=True)
    return contrib.view(t, contrib.shape[0] // t, -1).sum(dim=1)


def _grouped(
    xs: torch.Tensor,
    part: Any,
    segments: list[Segment],
    offs: torch.Tensor,
    ffn: ExpertFFN | None = None,
    bias: RowBias = (None, None),
) -> torch.Tensor:
    """Both projections of each segment's slots as one grouped GEMM each; ``offs`` as
    :meth:`LayerPlan.calls` (on the device, int32); ``bias``: the rows' biases (:class:`ExpertFFN`)."""
    outs, o = [], 0
    for i, (first, count, a) in enumerate(segments):
        b = segments[i + 1][2] if i + 1 < len(segments) else xs.shape[0]
        whole = len(segments) == 1
        xseg = xs if whole else xs[a:b]
        gu_b, down_b = (t if t is None or whole else t[a:b] for t in bias)
        oseg = offs if whole else offs[o : o + count]
        o += count
        if count == 1:  # one expert: F.linear (same result, fewer ops than a one-group call)
            hidden = _hidden(F.linear(xseg, part.gate_up[first]), ffn, gu_b)
            outs.append(_biased(F.linear(hidden, part.down[first]), down_b))
            continue
        gate_up_t, down_t = span_views(part, first, count)
        hidden = _hidden(F.grouped_mm(xseg, gate_up_t, offs=oseg), ffn, gu_b)
        outs.append(_biased(F.grouped_mm(hidden, down_t, offs=oseg), down_b))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def span_views(part: Any, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``part.gate_up_t`` / ``part.down_t`` over slots ``first .. first + count - 1``: made once per
    span and kept on the partition (a span's views never change; a resident layer's span recurs
    every step), so a grouped call slices nothing. Dequantizing slots are sliced each time."""
    if not isinstance(part.gate_up_t, torch.Tensor):
        return part.gate_up_t[first : first + count], part.down_t[first : first + count]
    cache = part.__dict__.setdefault("_span_views", {})
    views = cache.get((first, count))
    if views is None:
        if len(cache) >= 4096:  # spans of a buffer below 100%: bounded
            cache.clear()
        views = cache[(first, count)] = (
            part.gate_up_t[first : first + count],
            part.down_t[first : first + count],
        )
    return views


def _loop(
    xs: torch.Tensor,
    part: Any,
    segments: list[Segment],
    offs: np.ndarray,
    ffn: ExpertFFN | None = None,
    bias: RowBias = (None, None),
) -> torch.Tensor:
    """The same rows, two ``F.linear`` per used slot (the fallback path); ``offs`` on the host."""
    y = torch.empty_like(xs)
    o = 0
    gu_b, down_b = bias
    for first, count, a in segments:
        ends = offs[o : o + count]
        o += count
        starts = np.concatenate(([0], ends[:-1]))
        for s in np.flatnonzero(ends > starts).tolist():
            lo, hi = a + int(starts[s]), a + int(ends[s])
            hidden = _hidden(
                F.linear(xs[lo:hi], part.gate_up[first + s]), ffn, None if gu_b is None else gu_b[lo:hi]
            )
            y[lo:hi] = _biased(
                F.linear(hidden, part.down[first + s]), None if down_b is None else down_b[lo:hi]
            )
    return y
