"""Grouped-query attention over a packed step with a static KV cache.

A step holds several sequences, each contributing ``n_i`` new tokens at positions
``past_i .. past_i + n_i - 1`` (prefill chunks and single decode tokens mixed). New K/V are written
into each sequence's cache row, then:

* all sequences decoding one token: one batched SDPA over ``[B, heads, 1, max_ctx]`` with a
  length mask;
* otherwise: one SDPA per sequence (causal within the chunk, full over its past).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_runtime.layers.kv_cache import KVCache


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, step
) -> torch.Tensor:
    """Attend and update the cache.

    Args:
        q: ``[T, Hq, D]`` rotated queries; k, v: ``[T, Hkv, D]`` rotated keys and values.
        layer: decoder layer index into the cache.
        step: the step's :class:`~moe_runtime.engine.context.StepContext`.

    Returns:
        ``[T, Hq * D]`` attention output, in token order.
    """
    kc, vc = cache.k[layer], cache.v[layer]  # [rows, Hkv, max_len, D]
    kc[step.token_rows, :, step.positions] = k
    vc[step.token_rows, :, step.positions] = v
    if step.all_decode:
        rows = step.rows_t
        keys = kc[rows, :, : step.max_ctx]  # [B, Hkv, C, D]
        vals = vc[rows, :, : step.max_ctx]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, vals, attn_mask=step.decode_mask, enable_gqa=True
        )  # [B, Hq, 1, D]
        return out.reshape(q.shape[0], -1)
    outs = []
    for i, (start, n) in enumerate(zip(step.starts, step.num_new)):
        row, ctx = step.rows[i], step.ctx_lens[i]
        qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ki = kc[row, :, :ctx].unsqueeze(0)
        vi = vc[row, :, :ctx].unsqueeze(0)
        past = ctx - n
        if n == 1:
            oi = F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)
        elif past == 0:
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=past)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
        outs.append(oi[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(outs, dim=0)
