"""Grouped-query attention over a packed step with a paged KV cache.

A step holds several sequences, each contributing ``n_i`` new tokens at positions
``past_i .. past_i + n_i - 1`` (prefill chunks and single decode tokens mixed). The new K/V are
written into each sequence's blocks first (``StepContext.slots``: one ``index_copy_`` per layer
into the flat ``[num_blocks * block_size]`` view), then each group of queries attends over its
sequences' blocks, gathered into a contiguous tensor (``index_select`` of the block ids of the
step's block tables, ``moe_runtime.layers.kv_cache``) and handed to SDPA:

* every sequence decoding one token (all of a decode step, or the decodes of a mixed step): one
  batched SDPA over ``[B_d, heads, 1, ctx]`` with a length mask;
* the prefill chunks (causal within a chunk, full over its past): one padded SDPA over all of
  them when padding costs at most ``PAD_WASTE`` x the useful work
  (``moe_runtime.engine.context``), else one SDPA per chunk.

On CUDA, decodes read their blocks in place where the model allows it (``paged_decode``:
FlexAttention over the block tables; ``cache.flex``), and the SDPA backends are limited to flash,
memory-efficient and math (``torch.nn.attention.sdpa_kernel``): the cuDNN backend builds a new plan
whenever the KV length changes, i.e. at every decode step (7.3 ms of host time per call on an H100).

gpt-oss adds two options:

* a sliding window: a query at position ``p`` sees keys ``p - window + 1 .. p``. Such a layer's
  block group keeps only the blocks some window still covers (``moe_runtime.engine.kv_manager``
  frees the others). It attends per group of sequences (the decodes; the prefill chunks in one
  padded call, as above, or one each) over each sequence's blocks from the one holding
  ``past - window + 1`` to its last, under a mask of each query's window (causal within the
  chunk); the new keys were written before, so a chunk longer than the window still sees its own
  early keys. The :class:`WindowPlan` (block tables, masks) is built once per step and group and
  shared by the layers (``StepContext.cached``);
* attention sinks (``sinks [Hq]``): a learned logit per head that joins the softmax denominator
  and carries no value: ``out_sink = out * S / (S + exp(sink)) = out * sigmoid(lse - sink)``,
  ``lse`` being the log-sum-exp of the query's visible logits. On CPU the flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``, GQA native) returns ``out`` and ``lse``
  in one call under an additive mask (built once per step and dtype): no copies of q, k or v.
  Elsewhere (CUDA's gathered path, not yet run on a GPU: ``aten._scaled_dot_product_efficient_attention``
  with ``compute_log_sumexp`` returns ``lse`` but takes no GQA and wants an additive bias aligned
  to 16 keys; not wired untested) the sink is one extra key whose logit is the sink:
  queries, keys and values are padded by :data:`SINK_PAD` head dims (zeros; one copy each), a
  query holds ``sink_h / scale`` in the first of them, the extra key 1 there and 0 elsewhere, its
  value 0; real keys hold 0 there, so their logits are unchanged and the extra key's is ``sink_h``
  (to rounding). Either way the mask stays shared by the heads (a per-head float mask would cost
  ``heads x queries x keys`` elements per call, 2 GiB for a 4096-token bf16 prefill of
  gpt-oss-20b). Any mask rules out the flash backend on CUDA: those calls run the
  memory-efficient kernel, grouped-query K/V repeated to the query heads first (:func:`sdpa_gqa`).

The masks of the other paths are built once per step too (the decodes' length mask and the padded
prefill mask by ``StepContext.build``, a lone chunk's causal mask on first use). Latent attention
(``moe_runtime.layers.mla``) passes one cache tensor as keys and values: it is written and
gathered once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_runtime.layers.kv_cache import cdiv

# SDPA backends allowed on CUDA: none of them re-plans when the KV length changes
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# head dims added for attention sinks where SDPA's log-sum-exp is not available (CUDA): one
# carries the sink, the rest keep the width a multiple of 8
SINK_PAD = 8
# Per device type: repeat grouped-query K/V heads to the query heads before an SDPA call that the
# flash kernel cannot take (a mask, or head dims above 256; :func:`sdpa_gqa`). CUDA's
# memory-efficient kernel takes no GQA, so without this such calls run the math fallback.
EXPAND_GQA = {"cuda": True, "cpu": False}
FLASH_MAX_HEAD_DIM = 256


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: int,
    cache,
    step,
    sinks: torch.Tensor | None = None,
    kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the step's keys and values into ``cache``, then attend.

    Args:
        q: ``[T, Hq, D]`` rotated queries (or ``[T, Hq, 1, D]``, the model's per-head view: a
            decode's SDPA takes it as it is); k, v: ``[T, Hkv, D]`` rotated keys and values (the
            same tensor for latent attention), or None with ``kv``.
        layer: decoder layer index into the cache (``PagedKVCache`` or ``PagedMLACache``); a layer
            whose block group has a window attends over its sliding window.
        step: the step's :class:`~moe_runtime.engine.context.StepContext`.
        sinks: ``[Hq]`` attention-sink logits, or None (module docstring).
        kv: ``[T, 2 * Hkv, 1, D]`` the keys then the values in one tensor (a view into the
            fused q/k/v projection): one ``index_copy_`` into a cache that keeps them side by side
            (``cache.kv_flat``).

    Returns:
        ``[T, Hq * D]`` attention output, in token order.
    """
    group = cache.group_of[layer]
    window = cache.windows[group]
    kc, vc = cache.k_flat[layer], cache.v_flat[layer]  # [num_blocks * block_size, Hkv, D]
    both = getattr(cache, "kv_flat", None)
    both = None if both is None else both[layer]  # [num_blocks * block_size, 2 * Hkv, D]
    slots = step.slots[group]
    if kv is not None and both is not None:
        both.index_copy_(0, slots, kv)
    else:
        if kv is not None:
            k, v = kv.squeeze(2).chunk(2, dim=1)
        kc.index_copy_(0, slots, k)
        if vc is not kc:
            vc.index_copy_(0, slots, v)
    t = q.shape[0]
    flex = getattr(cache, "flex", None)  # set where decodes read the blocks in place (CUDA)
    if step.all_decode and flex is None and not q.is_cuda and window is None:  # the common CPU case
        return _decode(q, kc, vc, step, group, sinks, both).view(t, -1)
    if q.dim() == 4:
        q = q.squeeze(2)  # [T, Hq, D]
    if step.all_decode and flex is not None:  # blocks read in place
        return flex.decode(q, kc, vc, step, group, window, sinks).reshape(t, -1)
    backends = sdpa_kernel(CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        if window is not None:
            return _window_attention(q, kc, vc, step, group, window, sinks).reshape(t, -1)
        if step.all_decode:
            return _decode(q, kc, vc, step, group, sinks, both).view(t, -1)
        out = q.new_empty(q.shape)  # [T, Hq, D]
        if step.decode_tokens is not None:  # the decodes of a mixed step, in one call
            qd = q.index_select(0, step.decode_tokens)
            if flex is not None:
                od = flex.decode(qd, kc, vc, step, group, None, sinks).squeeze(2)
            else:
                od = _decode(qd, kc, vc, step, group, sinks, both).squeeze(2)
            out.index_copy_(0, step.decode_tokens, od)
        if step.prefill_mask is not None:  # every prefill chunk in one padded call
            out.index_copy_(0, step.prefill_tokens, _prefill_padded(q, kc, vc, step, group, sinks))
            return out.reshape(t, -1)
        for i in step.prefill_seqs:
            start, n, ctx = step.starts[i], step.num_new[i], step.ctx_lens[i]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            slots = step.cached(("chunk", group, i), _chunk_slots, step, group, i)
            ki, vi = _gather_kv(kc, vc, slots, 1, ctx)
            if ctx == n and sinks is None:
                oi = sdpa_gqa(qi, ki, vi, is_causal=True)
            else:
                mask = step.cached(("chunk", i), _causal, n, ctx, q.device)
                oi = _sdpa(qi, ki, vi, mask, sinks, step, ("chunk", i))
            out[start : start + n] = oi[0].transpose(0, 1)
        return out.reshape(t, -1)


def sdpa_gqa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``q [B, Hq, Lq, D]`` over grouped-query ``keys``/``vals``
    ``[B, Hkv, C, D]`` (``kwargs``: ``attn_mask``, ``is_causal``, ``scale``).

    Native GQA (``enable_gqa``) where a kernel takes it: the CPU's flash kernel, and CUDA's flash
    kernel (no mask, ``D <= 256``). Otherwise, on CUDA (:data:`EXPAND_GQA`), the K/V heads are
    repeated to the query heads first (transformers' ``repeat_kv`` layout: query head ``h`` reads
    K/V head ``h // (Hq / Hkv)``), so the memory-efficient kernel runs the call: the only other
    kernel, math, takes GQA but upcasts to fp32 and builds ``[B, Hq, Lq, C]`` scores, 4.4 GiB for a
    4,096-token chunk of gpt-oss-20b, where the repeated K/V of its context take 70 MiB. Values
    equal the native call's (each query head sees the same keys), up to the kernel's rounding."""
    hq, hkv = q.shape[-3], keys.shape[-3]
    flash_ok = kwargs.get("attn_mask") is None and q.shape[-1] <= FLASH_MAX_HEAD_DIM
    if hq == hkv or flash_ok or not EXPAND_GQA[q.device.type]:
        return F.scaled_dot_product_attention(q, keys, vals, enable_gqa=True, **kwargs)
    g = hq // hkv
    k = keys.repeat_interleave(g, dim=-3)
    v = k if vals is keys else vals.repeat_interleave(g, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def token_slots(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """The flat slots (``block * block_size + offset``) of positions ``0 .. length - 1`` of each
    row of ``table [S, nb]``, ``[S * length]`` (row after row)."""
    if torch.compiler.is_compiling():  # each position's block looked up: no guard on length % block_size
        pos = torch.arange(length, device=table.device)
        return (table.index_select(1, pos // block_size) * block_size + pos % block_size).reshape(-1)
    offsets = torch.arange(block_size, device=table.device)
    return (table[:, :, None] * block_size + offsets).reshape(table.shape[0], -1)[:, :length].reshape(-1)


def gather(flat: torch.Tensor, slots: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``flat [num_blocks * block_size, H, D]`` at ``slots [rows * length]`` as ``[rows, H, length,
    D]`` (a transposed view of one copy)."""
    return flat.index_select(0, slots).view(rows, length, *flat.shape[1:]).transpose(1, 2)


def _gather_kv(kc, vc, slots, rows, length) -> tuple[torch.Tensor, torch.Tensor]:
    keys = gather(kc, slots, rows, length)
    return keys, keys if vc is kc else gather(vc, slots, rows, length)


def _decode_slots(step, group: int) -> torch.Tensor:
    """The decoding sequences' slots over their longest context ``[B_d * decode_ctx]``."""
    table = step.tables[group]
    if step.decode_seq_t is not None:
        table = table.index_select(0, step.decode_seq_t)
    if not torch.compiler.is_compiling():  # (compiled, token_slots looks up the blocks it needs)
        table = table[:, : cdiv(step.decode_ctx, step.block_size)]
    return token_slots(table, step.block_size, _decode_ctx(step))


def _decode_ctx(step) -> int:
    """The decoding sequences' longest context: ``step.decode_ctx``, or while compiling the mask's
    last dim, which the compiled step marks symbolic, so one graph serves every length from its
    first compile (an int attribute would be specialised on its first value)."""
    return step.decode_mask.shape[-1] if torch.compiler.is_compiling() else step.decode_ctx


def _prefill_slots(step, group: int) -> torch.Tensor:
    """The padded prefill chunks' slots over their longest context ``[P * prefill_ctx]``."""
    ctx = step.prefill_mask.shape[-1]
    table = step.tables[group].index_select(0, step.prefill_seq_t)
    return token_slots(table[:, : cdiv(ctx, step.block_size)], step.block_size, ctx)


def _chunk_slots(step, group: int, i: int) -> torch.Tensor:
    """Sequence ``i``'s slots over its context ``[ctx_i]``."""
    ctx = step.ctx_lens[i]
    return token_slots(step.tables[group][i : i + 1, : cdiv(ctx, step.block_size)], step.block_size, ctx)


def _causal(n: int, ctx: int, device: torch.device) -> torch.Tensor:
    """``[n, ctx]`` bool: query ``i`` (position ``ctx - n + i``) sees keys ``0 .. ctx - n + i``."""
    return torch.ones(n, ctx, dtype=torch.bool, device=device).tril(diagonal=ctx - n)


def _sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor | None = None,
    step=None,
    mask_key=None,
) -> torch.Tensor:
    """SDPA of ``q [B, Hq, Lq, D]`` over ``keys``/``vals [B, Hkv, C, D]`` with the boolean mask
    ``visible [B or 1, 1, Lq, C]`` (or ``[Lq, C]``; no query row fully masked) and the attention
    sinks ``sinks [Hq]`` (module docstring). ``mask_key`` names ``visible`` in ``step.memo``: its
    float form (the log-sum-exp route's) is then built once per step and dtype."""
    if sinks is None:
        return sdpa_gqa(q, keys, vals, attn_mask=visible)
    if q.device.type == "cpu":  # the CPU flash kernel returns the log-sum-exp
        if step is None:
            bias = _additive(visible, q.dtype)
        else:
            bias = step.cached(("additive", mask_key, q.dtype), _additive, visible, q.dtype)
        return _sinks_by_lse(q, keys, vals, bias, sinks)
    return _sinks_by_padding(q, keys, vals, visible, sinks)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as SDPA's additive one (0 seen, -inf hidden), ``[B or 1, 1, Lq, C]``."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )
    return bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))


def _sinks_by_lse(q, keys, vals, bias, sinks) -> torch.Tensor:
    """Sinks from SDPA's log-sum-exp (CPU flash kernel): ``out * sigmoid(lse - sink)``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, vals, 0.0, False, attn_mask=bias
    )[:2]
    keep = torch.sigmoid(lse - sinks.float().view(-1, 1))  # [B, Hq, Lq] fp32
    return out * keep.unsqueeze(-1).to(out.dtype)


def _sinks_by_padding(q, keys, vals, visible, sinks) -> torch.Tensor:
    """Sinks as one extra key whose logit is the sink (module docstring): one padded copy each of
    q, k and v; for backends that do not return the log-sum-exp."""
    d, heads = q.shape[-1], q.shape[1]
    scale = d**-0.5
    qs = F.pad(q, (0, SINK_PAD))
    qs[..., d] = (sinks.float() / scale).to(q.dtype).view(heads, 1)
    ks = F.pad(keys, (0, SINK_PAD, 0, 1))
    ks[..., -1, d] = 1
    vs = F.pad(vals, (0, SINK_PAD, 0, 1))
    mask = F.pad(visible, (0, 1), value=True)
    out = sdpa_gqa(qs, ks, vs, attn_mask=mask, scale=scale)
    return out[..., :d]


def _prefill_padded(q: torch.Tensor, kc, vc, step, group: int, sinks=None) -> torch.Tensor:
    """One SDPA for all prefill chunks, padded to ``[P, Hq, max_new, D]``; returns their tokens'
    outputs ``[sum n_p, Hq, D]`` in ``step.prefill_tokens`` order."""
    p, _, max_new, ctx = step.prefill_mask.shape
    qp = q.new_zeros((p * max_new, q.shape[1], q.shape[2]))
    qp.index_copy_(0, step.prefill_pad, q.index_select(0, step.prefill_tokens))
    qp = qp.view(p, max_new, q.shape[1], q.shape[2]).transpose(1, 2)  # [P, Hq, max_new, D]
    slots = step.cached(("prefill-slots", group), _prefill_slots, step, group)
    keys, vals = _gather_kv(kc, vc, slots, p, ctx)
    out = _sdpa(qp, keys, vals, step.prefill_mask, sinks, step, "prefill")
    return out.transpose(1, 2).reshape(p * max_new, q.shape[1], q.shape[2]).index_select(0, step.prefill_pad)


def _decode(q: torch.Tensor, kc, vc, step, group: int, sinks=None, both=None) -> torch.Tensor:
    """One batched SDPA for the decoding sequences' queries ``q [B_d, Hq, (1,) D]`` -> ``[B_d, Hq, 1, D]``.

    ``both``: the layer's keys and values side by side (``cache.kv_flat[layer]``), gathered with
    one ``index_select`` and split by one ``unbind``; else ``kc`` and ``vc`` one gather each. No
    mask when every context is the longest (``step.decode_full``)."""
    slots = step.cached(("decode-slots", group), _decode_slots, step, group)
    b, ctx = q.shape[0], _decode_ctx(step)
    if both is not None:
        hkv = kc.shape[1]
        rows = both.index_select(0, slots).view(b, ctx, 2, hkv, both.shape[-1])
        keys, vals = rows.permute(2, 0, 3, 1, 4).unbind(0)  # [B_d, Hkv, C, D] each
    else:
        keys, vals = _gather_kv(kc, vc, slots, b, ctx)  # [B_d, Hkv, C, D]
    if torch.compiler.is_compiling() and b > 1:  # several sequences: one graph, masked at any lengths
        mask = step.decode_mask
    else:
        mask = None if step.decode_full else step.decode_mask
    q4 = q if q.dim() == 4 else q.unsqueeze(2)  # [B_d, Hq, 1, D]
    if q.is_cuda and sinks is None:
        return decode_grouped(q4.squeeze(2), keys, vals, mask)
    if sinks is None:
        return F.scaled_dot_product_attention(q4, keys, vals, attn_mask=mask, enable_gqa=True)
    return _sdpa(q4, keys, vals, step.decode_mask, sinks, step, "decode")


def decode_grouped(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query decode attention as plain multi-head attention, for CUDA's fused kernels.

    Each KV head's ``G = Hq / Hkv`` query heads (heads ``h * G .. h * G + G - 1``, the layout of
    transformers' ``repeat_kv``) become ``G`` query rows of that head. Every row of a sequence sees
    the same keys, so the result equals grouped-query SDPA, but needs neither ``enable_gqa`` (which
    the memory-efficient kernel lacks) nor a mask when every context is full: the flash or
    memory-efficient kernel runs it instead of the math fallback, whose composite ops cost about
    0.6 ms of host time per layer on an H100.

    Args:
        q: ``[B, Hq, D]`` one query per decoding sequence.
        keys, vals: ``[B, Hkv, C, D]`` their cached keys and values.
        visible: ``[B, 1, 1, C]`` bool, key ``c`` inside sequence ``b``'s context; None = all.

    Returns:
        ``[B, Hq, 1, D]``, as :func:`_sdpa` of ``q.unsqueeze(2)`` would.
    """
    b, hq, d = q.shape
    hkv = keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), keys, vals, attn_mask=visible)
    return out.reshape(b, hq, 1, d)


@dataclass(frozen=True, slots=True)
class WindowGroup:
    """Sequences of a step attended in one SDPA over the blocks their windows cover.

    Attributes:
        slots: ``[S * keys]`` flat slots of each sequence's blocks from its first block still in
            its first query's window (key ``c`` of sequence ``s`` is at position
            ``first_s * block_size + c``). rows: ``S``. keys: blocks x block size.
        tokens: ``[n]`` their tokens' indices in the packed step. pad: ``[n]`` each token's index
            in the padded ``[S * max_new]`` queries. max_new: the longest chunk.
        mask: ``[S, 1, max_new, nb * block_size]`` bool, each query's window (padded queries see
            key 0 only). start: the first token of the group's only chunk (its tokens are then a
            slice), or None.
    """

    slots: torch.Tensor
    rows: int
    keys: int
    tokens: torch.Tensor
    pad: torch.Tensor
    max_new: int
    mask: torch.Tensor
    start: int | None


def _window_plan(step, group: int, window: int, device: torch.device) -> list[WindowGroup]:
    """The step's groups over one sliding block group: decodes in one group, prefill chunks in
    one padded group where the step pads them (``step.prefill_mask``), else one group each."""
    dec = step.decode_seqs
    sets = [dec] if dec else []
    sets += [step.prefill_seqs] if step.prefill_mask is not None else [[i] for i in step.prefill_seqs]
    return [_window_group(step, group, seqs, window, device) for seqs in sets]


def _window_group(step, group: int, seqs: list[int], window: int, device: torch.device) -> WindowGroup:
    bs = step.block_size
    new = torch.tensor([step.num_new[i] for i in seqs])
    ctx = torch.tensor([step.ctx_lens[i] for i in seqs])
    past = ctx - new
    first = (past - window + 1).clamp(min=0) // bs  # first block a query of the chunk sees
    nb = int(((ctx + bs - 1) // bs - first).max())
    host_tab = step.tables_host[group]
    table = torch.zeros(len(seqs), nb, dtype=torch.int64)
    for r, i in enumerate(seqs):
        row = host_tab[i, int(first[r]) : int(first[r]) + nb]
        table[r, : len(row)] = torch.from_numpy(row)
    max_new = int(new.max())
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), new)
    within = torch.arange(int(new.sum())) - torch.repeat_interleave(new.cumsum(0) - new, new)
    starts = torch.tensor([step.starts[i] for i in seqs])
    i = torch.arange(max_new)[None, :, None]  # query index in the chunk
    qpos = past[:, None, None] + i
    kpos = first[:, None, None] * bs + torch.arange(nb * bs)[None, None, :]
    seen = (kpos <= qpos) & (kpos > qpos - window)
    pad_row = torch.arange(nb * bs)[None, None, :] == 0
    mask = torch.where(i < new[:, None, None], seen, pad_row)[:, None]
    slots = (table[:, :, None] * bs + torch.arange(bs)).reshape(-1)
    host = torch.cat([slots, starts[seq_of] + within, seq_of * max_new + within])
    dev = host.to(device)  # one copy
    s, n = slots.numel(), len(within)
    start = step.starts[seqs[0]] if len(seqs) == 1 else None
    return WindowGroup(
        dev[:s], len(seqs), nb * bs, dev[s : s + n], dev[s + n :], max_new, mask.to(device), start
    )


def _padded(x: torch.Tensor, g: WindowGroup) -> torch.Tensor:
    """The group's rows of ``x [T, H, D]`` as ``[S, H, max_new, D]`` (zeros where a chunk is short)."""
    s = g.rows
    if g.start is not None:  # one chunk: a view
        return x[g.start : g.start + g.max_new].transpose(0, 1).unsqueeze(0)
    if g.max_new == 1:
        return x.index_select(0, g.tokens).unsqueeze(2)
    buf = x.new_zeros((s * g.max_new, x.shape[1], x.shape[2]))
    buf.index_copy_(0, g.pad, x.index_select(0, g.tokens))
    return buf.view(s, g.max_new, x.shape[1], x.shape[2]).transpose(1, 2)


def _window_attention(q, kc, vc, step, group: int, window: int, sinks) -> torch.Tensor:
    """Sliding-window attention over the blocks each sequence's windows cover (module docstring);
    the step's new keys are already in the blocks."""
    plan = step.cached(("window", group), _window_plan, step, group, window, q.device)
    out = torch.empty_like(q)
    for gi, g in enumerate(plan):
        keys, vals = _gather_kv(kc, vc, g.slots, g.rows, g.keys)
        o = _sdpa(_padded(q, g), keys, vals, g.mask, sinks, step, ("window", group, gi))
        s, heads, d = g.rows, q.shape[1], q.shape[2]
        o = o.transpose(1, 2).reshape(s * g.max_new, heads, d)
        if g.start is not None:
            out[g.start : g.start + g.max_new] = o
        else:
            out.index_copy_(0, g.tokens, o if g.max_new == 1 else o.index_select(0, g.pad))
    return out
