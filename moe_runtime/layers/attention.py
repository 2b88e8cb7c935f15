"""Grouped-query attention over a packed step with a static KV cache.

A step holds several sequences, each contributing ``n_i`` new tokens at positions
``past_i .. past_i + n_i - 1`` (prefill chunks and single decode tokens mixed). New K/V are written
into each sequence's cache row, then:

* every sequence decoding one token (all of a decode step, or the decodes of a mixed step): one
  batched SDPA over ``[B_d, heads, 1, ctx]`` with a length mask;
* the prefill chunks (causal within a chunk, full over its past): one padded SDPA over all of
  them when padding costs at most ``PAD_WASTE`` x the useful work
  (``moe_runtime.engine.context``), else one SDPA per chunk.

On CUDA the SDPA backends are limited to flash, memory-efficient and math
(``torch.nn.attention.sdpa_kernel``): the cuDNN backend builds a new plan whenever the KV length
changes, i.e. at every decode step (issue 14: 7.3 ms of host time per call on an H100).

gpt-oss adds two options:

* a sliding window: a query at position ``p`` sees keys ``p - window + 1 .. p``. A layer whose
  window is shorter than the cache keeps a ring of ``window`` KV positions per row (position ``p``
  at index ``p % window``, ``moe_runtime.layers.kv_cache``), so its KV memory does not grow with
  the context. Such a layer attends per group of sequences (the decodes; the prefill chunks in one
  padded call, as above, or one each) over ``[ring | new tokens]``: the ring as the step found it
  (``min(window, past)`` positions) and the group's new keys, under a mask that keeps each query's
  window (causal within the chunk); then each sequence's last ``window`` new keys and values are
  written. A chunk longer than the window thus still sees its own early keys. The
  :class:`RingPlan` (indices, masks) is built once per step and window and shared by the layers
  (``StepContext.cached``);
* attention sinks (``sinks [Hq]``): a learned logit per head that joins the softmax denominator
  and carries no value: ``out_sink = out * S / (S + exp(sink)) = out * sigmoid(lse - sink)``,
  ``lse`` being the log-sum-exp of the query's visible logits. On CPU the flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``, GQA native) returns ``out`` and ``lse``
  in one call under an additive mask (built once per step and dtype): no copies of q, k or v.
  Elsewhere (CUDA, not yet run on a GPU: ``aten._scaled_dot_product_efficient_attention`` with
  ``compute_log_sumexp`` returns ``lse`` but takes no GQA and wants an additive bias aligned to 16
  keys; not wired untested) the sink is one extra key whose logit is the sink:
  queries, keys and values are padded by :data:`SINK_PAD` head dims (zeros; one copy each), a
  query holds ``sink_h / scale`` in the first of them, the extra key 1 there and 0 elsewhere, its
  value 0; real keys hold 0 there, so their logits are unchanged and the extra key's is ``sink_h``
  (to rounding). Either way the mask stays shared by the heads (a per-head float mask would cost
  ``heads x queries x keys`` elements per call, 2 GiB for a 4096-token bf16 prefill of
  gpt-oss-20b). Any mask rules out the flash backend on CUDA: those calls run the
  memory-efficient kernel (or math).

The masks of the other paths are built once per step too (the decodes' length mask and the padded
prefill mask by ``StepContext.build``, a lone chunk's causal mask on first use).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_runtime.layers.kv_cache import KVCache

# SDPA backends allowed on CUDA: none of them re-plans when the KV length changes
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# head dims added for attention sinks where SDPA's log-sum-exp is not available (CUDA): one
# carries the sink, the rest keep the width a multiple of 8
SINK_PAD = 8


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: KVCache,
    step,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend and update the cache.

    Args:
        q: ``[T, Hq, D]`` rotated queries; k, v: ``[T, Hkv, D]`` rotated keys and values.
        layer: decoder layer index into the cache; a layer with a ring (``cache.ring``) attends
            over its sliding window.
        step: the step's :class:`~moe_runtime.engine.context.StepContext`.
        sinks: ``[Hq]`` attention-sink logits, or None (module docstring).

    Returns:
        ``[T, Hq * D]`` attention output, in token order.
    """
    kc, vc = cache.k[layer], cache.v[layer]  # [rows, Hkv, max_len or window, D]
    window = cache.ring.get(layer)
    if window is None:
        kc[step.token_rows, :, step.positions] = k
        vc[step.token_rows, :, step.positions] = v
        if step.all_decode and not q.is_cuda:  # the common CPU case: no backend context
            return _decode(q, kc, vc, step, sinks).reshape(q.shape[0], -1)
    backends = sdpa_kernel(CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        if window is not None:
            return _ring_attention(q, k, v, kc, vc, step, sinks, window).reshape(q.shape[0], -1)
        if step.all_decode:
            return _decode(q, kc, vc, step, sinks).reshape(q.shape[0], -1)
        out = torch.empty_like(q)  # [T, Hq, D]
        if step.rows_t is not None:  # the decodes of a mixed step, in one call
            od = _decode(q.index_select(0, step.decode_tokens), kc, vc, step, sinks).squeeze(2)
            out.index_copy_(0, step.decode_tokens, od)
        if step.prefill_mask is not None:  # every prefill chunk in one padded call
            out.index_copy_(0, step.prefill_tokens, _prefill_padded(q, kc, vc, step, sinks))
            return out.reshape(q.shape[0], -1)
        for i in step.prefill_seqs:
            start, n = step.starts[i], step.num_new[i]
            row, ctx = step.rows[i], step.ctx_lens[i]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ki = kc[row, :, :ctx].unsqueeze(0)
            vi = vc[row, :, :ctx].unsqueeze(0)
            past = ctx - n
            if past == 0 and sinks is None:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
                mask = step.cached(("chunk", i), _causal, n, ctx, q.device)
                oi = _sdpa(qi, ki, vi, mask, sinks, step, ("chunk", i))
            out[start : start + n] = oi[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)


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
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible, enable_gqa=True)
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
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[..., :d]


def _prefill_padded(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step, sinks=None) -> torch.Tensor:
    """One SDPA for all prefill chunks, padded to ``[P, Hq, max_new, D]``; returns their tokens'
    outputs ``[sum n_p, Hq, D]`` in ``step.prefill_tokens`` order."""
    p, _, max_new, ctx = step.prefill_mask.shape
    qp = q.new_zeros((p * max_new, q.shape[1], q.shape[2]))
    qp.index_copy_(0, step.prefill_pad, q.index_select(0, step.prefill_tokens))
    qp = qp.view(p, max_new, q.shape[1], q.shape[2]).transpose(1, 2)  # [P, Hq, max_new, D]
    keys = kc[step.prefill_rows_t, :, :ctx]  # [P, Hkv, C, D]
    vals = vc[step.prefill_rows_t, :, :ctx]
    out = _sdpa(qp, keys, vals, step.prefill_mask, sinks, step, "prefill")
    return out.transpose(1, 2).reshape(p * max_new, q.shape[1], q.shape[2]).index_select(0, step.prefill_pad)


def _decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step, sinks=None) -> torch.Tensor:
    """One batched SDPA for the decoding sequences' queries ``q [B_d, Hq, D]`` -> ``[B_d, Hq, 1, D]``."""
    keys = kc[step.rows_t, :, : step.decode_ctx]  # [B_d, Hkv, C, D]
    vals = vc[step.rows_t, :, : step.decode_ctx]
    if q.is_cuda and sinks is None:
        return decode_grouped(q, keys, vals, None if step.decode_full else step.decode_mask)
    return _sdpa(q.unsqueeze(2), keys, vals, step.decode_mask, sinks, step, "decode")


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
class RingGroup:
    """Sequences of a step attended in one SDPA over their ring and their new tokens.

    Attributes:
        rows: ``[S]`` KV rows. tokens: ``[n]`` their tokens' indices in the packed step.
        pad: ``[n]`` each token's index in the padded ``[S * max_new]`` queries.
        max_new: the longest chunk. ring_len: ring indices read (``min(window, longest past)``).
        mask: ``[S, 1, max_new, ring_len + max_new]`` bool, keys = ring then the new tokens.
        start: the first token of the group's only chunk (its tokens are then a slice), or None.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    pad: torch.Tensor
    max_new: int
    ring_len: int
    mask: torch.Tensor
    start: int | None


@dataclass(frozen=True, slots=True)
class RingPlan:
    """A step's attention over the rings of one window: the groups, then the writes (each
    sequence's last ``window`` new tokens: token indices ``tokens``, to ``rows`` at ``slots``)."""

    groups: list[RingGroup]
    tokens: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor


def _ring_plan(step, window: int, device: torch.device) -> RingPlan:
    """The step's :class:`RingPlan` for ``window``: decodes in one group, prefill chunks in one
    padded group where the step pads them (``step.prefill_mask``), else one group each."""
    dec = [i for i in range(step.num_seqs) if i not in step.prefill_seqs]
    sets = [dec] if dec else []
    sets += [step.prefill_seqs] if step.prefill_mask is not None else [[i] for i in step.prefill_seqs]
    groups = [_ring_group(step, seqs, window, device) for seqs in sets]
    tokens, rows, slots = [], [], []
    for i in range(step.num_seqs):  # positions past .. ctx - 1; the last ``window`` are kept
        first = max(step.ctx_lens[i] - step.num_new[i], step.ctx_lens[i] - window)
        pos = torch.arange(first, step.ctx_lens[i])
        tokens.append(step.starts[i] + pos - (step.ctx_lens[i] - step.num_new[i]))
        rows.append(torch.full_like(pos, step.rows[i]))
        slots.append(pos % window)
    host = torch.stack([torch.cat(tokens), torch.cat(rows), torch.cat(slots)])
    dev = host.to(device)  # one copy
    return RingPlan(groups, dev[0], dev[1], dev[2])


def _ring_group(step, seqs: list[int], window: int, device: torch.device) -> RingGroup:
    new = torch.tensor([step.num_new[i] for i in seqs])
    past = torch.tensor([step.ctx_lens[i] - step.num_new[i] for i in seqs])
    max_new, ring_len = int(new.max()), min(window, int(past.max()))
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), new)
    within = torch.arange(int(new.sum())) - torch.repeat_interleave(new.cumsum(0) - new, new)
    starts = torch.tensor([step.starts[i] for i in seqs])
    i = torch.arange(max_new)[None, :, None]  # query index in the chunk
    real = i < new[:, None, None]
    # ring index j holds position past - 1 - ((past - 1 - j) mod window), written once j < past
    j = torch.arange(ring_len)[None, None, :]
    p = past[:, None, None]
    held = p - 1 - (p - 1 - j).remainder(window)
    sees_ring = real & (j < p) & (held > p + i - window)
    m = torch.arange(max_new)[None, None, :]  # new key index
    sees_new = torch.where(real, (m <= i) & (m > i - window), m == 0)  # padded queries: key 0
    mask = torch.cat([sees_ring, sees_new], dim=-1)[:, None]
    host = torch.cat(
        [torch.tensor([step.rows[i] for i in seqs]), starts[seq_of] + within, seq_of * max_new + within]
    )
    dev = host.to(device)
    s, n = len(seqs), len(within)
    start = step.starts[seqs[0]] if s == 1 else None
    return RingGroup(dev[:s], dev[s : s + n], dev[s + n :], max_new, ring_len, mask.to(device), start)


def _padded(x: torch.Tensor, g: RingGroup) -> torch.Tensor:
    """The group's rows of ``x [T, H, D]`` as ``[S, H, max_new, D]`` (zeros where a chunk is short)."""
    s = g.rows.shape[0]
    if g.start is not None:  # one chunk: a view
        return x[g.start : g.start + g.max_new].transpose(0, 1).unsqueeze(0)
    if g.max_new == 1:
        return x.index_select(0, g.tokens).unsqueeze(2)
    buf = x.new_zeros((s * g.max_new, x.shape[1], x.shape[2]))
    buf.index_copy_(0, g.pad, x.index_select(0, g.tokens))
    return buf.view(s, g.max_new, x.shape[1], x.shape[2]).transpose(1, 2)


def _ring_attention(q, k, v, kc, vc, step, sinks, window: int) -> torch.Tensor:
    """Sliding-window attention over ring caches ``kc``/``vc [rows, Hkv, window, D]`` (module
    docstring): every group attends over its ring, read before this step writes it, and its new
    tokens; then each sequence's last ``window`` new keys and values are written."""
    plan = step.cached(("ring", window), _ring_plan, step, window, q.device)
    out = torch.empty_like(q)
    for gi, g in enumerate(plan.groups):
        keys, vals = _padded(k, g), _padded(v, g)
        if g.ring_len:
            keys = torch.cat((kc[g.rows, :, : g.ring_len], keys), dim=2)
            vals = torch.cat((vc[g.rows, :, : g.ring_len], vals), dim=2)
        o = _sdpa(_padded(q, g), keys, vals, g.mask, sinks, step, ("ring", window, gi))
        s, heads, d = g.rows.shape[0], q.shape[1], q.shape[2]
        o = o.transpose(1, 2).reshape(s * g.max_new, heads, d)
        if g.start is not None:
            out[g.start : g.start + g.max_new] = o
        else:
            out.index_copy_(0, g.tokens, o if g.max_new == 1 else o.index_select(0, g.pad))
    kc[plan.rows, :, plan.slots] = k.index_select(0, plan.tokens)
    vc[plan.rows, :, plan.slots] = v.index_select(0, plan.tokens)
    return out
