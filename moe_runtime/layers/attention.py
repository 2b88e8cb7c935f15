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

gpt-oss adds two options, each a change of the mask only (:func:`_sdpa`):

* a sliding window (``window``): a query at position ``p`` sees keys ``p - window + 1 .. p``;
  the step's boolean masks (a visible prefix per query) keep their last ``window`` keys. The KV
  cache stays full length (memory is not saved, the keys outside the window are masked out);
* attention sinks (``sinks [Hq]``): a learned logit per head that joins the softmax denominator
  and carries no value. Each call gets one extra key, always visible, whose logit is the sink:
  queries, keys and values are padded by :data:`SINK_PAD` head dims (zeros; one copy each), a
  query holds ``sink_h / scale`` in the first of them, the extra key 1 there and 0 elsewhere,
  its value 0; real keys hold 0 there, so their logits are unchanged and the extra key's is
  ``sink_h`` (to rounding). The softmax then equals transformers' ``[logits | sink]`` softmax
  with the sink dropped; the output's padded dims are dropped. The mask stays boolean and shared
  by the heads (a per-head float mask would cost ``heads x queries x keys`` elements per call,
  2 GiB for a 4096-token bf16 prefill of gpt-oss-20b). Any mask rules out the flash backend on
  CUDA: those calls run the memory-efficient kernel (or math); on CPU any SDPA backend takes it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_runtime.layers.kv_cache import KVCache

# SDPA backends allowed on CUDA: none of them re-plans when the KV length changes
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# head dims added for attention sinks: one carries the sink, the rest keep the width a multiple of 8
SINK_PAD = 8


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: KVCache,
    step,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attend and update the cache.

    Args:
        q: ``[T, Hq, D]`` rotated queries; k, v: ``[T, Hkv, D]`` rotated keys and values.
        layer: decoder layer index into the cache.
        step: the step's :class:`~moe_runtime.engine.context.StepContext`.
        sinks: ``[Hq]`` attention-sink logits, or None (module docstring).
        window: sliding window in positions (>= 1), or None for full causal attention.

    Returns:
        ``[T, Hq * D]`` attention output, in token order.
    """
    kc, vc = cache.k[layer], cache.v[layer]  # [rows, Hkv, max_len, D]
    kc[step.token_rows, :, step.positions] = k
    vc[step.token_rows, :, step.positions] = v
    extra = None if sinks is None and window is None else (sinks, window)
    if step.all_decode and not q.is_cuda:  # the common CPU case: no backend context
        return _decode(q, kc, vc, step, extra).reshape(q.shape[0], -1)
    backends = sdpa_kernel(CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        if step.all_decode:
            return _decode(q, kc, vc, step, extra).reshape(q.shape[0], -1)
        out = torch.empty_like(q)  # [T, Hq, D]
        if step.rows_t is not None:  # the decodes of a mixed step, in one call
            od = _decode(q.index_select(0, step.decode_tokens), kc, vc, step, extra).squeeze(2)
            out.index_copy_(0, step.decode_tokens, od)
        if step.prefill_mask is not None:  # every prefill chunk in one padded call
            out.index_copy_(0, step.prefill_tokens, _prefill_padded(q, kc, vc, step, extra))
            return out.reshape(q.shape[0], -1)
        for i in step.prefill_seqs:
            start, n = step.starts[i], step.num_new[i]
            row, ctx = step.rows[i], step.ctx_lens[i]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ki = kc[row, :, :ctx].unsqueeze(0)
            vi = vc[row, :, :ctx].unsqueeze(0)
            past = ctx - n
            if past == 0 and extra is None:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
                mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=past)
                oi = _sdpa(qi, ki, vi, mask, extra)
            out[start : start + n] = oi[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)


def _sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    visible: torch.Tensor,
    extra: tuple[torch.Tensor | None, int | None] | None,
) -> torch.Tensor:
    """SDPA of ``q [B, Hq, Lq, D]`` over ``keys``/``vals [B, Hkv, C, D]`` with the boolean mask
    ``visible [B or 1, 1, Lq, C]`` (or ``[Lq, C]``; each query sees a prefix of the keys);
    ``extra = (sinks [Hq] or None, window or None)`` applies the module docstring's sliding window
    and attention sinks."""
    if extra is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible, enable_gqa=True)
    sinks, window = extra
    if window is not None:  # keep each query's last ``window`` visible keys
        visible = visible & (visible.flip(-1).cumsum(-1).flip(-1) <= window)
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible, enable_gqa=True)
    d, heads = q.shape[-1], q.shape[1]
    scale = d**-0.5
    # one extra key per row (1 in dim d, 0 elsewhere; value 0), always visible; each query carries
    # its head's sink / scale in dim d, where the real keys hold 0: its logit is the sink
    qs = F.pad(q, (0, SINK_PAD))
    qs[..., d] = (sinks.float() / scale).to(q.dtype).view(heads, 1)
    ks = F.pad(keys, (0, SINK_PAD, 0, 1))
    ks[..., -1, d] = 1
    vs = F.pad(vals, (0, SINK_PAD, 0, 1))
    mask = F.pad(visible, (0, 1), value=True)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[..., :d]


def _prefill_padded(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step, extra=None) -> torch.Tensor:
    """One SDPA for all prefill chunks, padded to ``[P, Hq, max_new, D]``; returns their tokens'
    outputs ``[sum n_p, Hq, D]`` in ``step.prefill_tokens`` order."""
    p, _, max_new, ctx = step.prefill_mask.shape
    qp = q.new_zeros((p * max_new, q.shape[1], q.shape[2]))
    qp.index_copy_(0, step.prefill_pad, q.index_select(0, step.prefill_tokens))
    qp = qp.view(p, max_new, q.shape[1], q.shape[2]).transpose(1, 2)  # [P, Hq, max_new, D]
    keys = kc[step.prefill_rows_t, :, :ctx]  # [P, Hkv, C, D]
    vals = vc[step.prefill_rows_t, :, :ctx]
    out = _sdpa(qp, keys, vals, step.prefill_mask, extra)
    return out.transpose(1, 2).reshape(p * max_new, q.shape[1], q.shape[2]).index_select(0, step.prefill_pad)


def _decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, step, extra=None) -> torch.Tensor:
    """One batched SDPA for the decoding sequences' queries ``q [B_d, Hq, D]`` -> ``[B_d, Hq, 1, D]``."""
    keys = kc[step.rows_t, :, : step.decode_ctx]  # [B_d, Hkv, C, D]
    vals = vc[step.rows_t, :, : step.decode_ctx]
    return _sdpa(q.unsqueeze(2), keys, vals, step.decode_mask, extra)
