"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a packed step, caching the latent.

Per token: ``q`` from ``q_proj`` (or ``q_a_proj -> RMSNorm -> q_b_proj`` with ``q_lora_rank``),
split per head into a no-position part ``[nope]`` and a rotary part ``[rope]``;
``kv_a_proj_with_mqa`` gives the compressed KV latent ``c [kv_lora_rank]`` (RMSNorm'd) and one
rotary key ``k_rope [rope]`` shared by all heads. RoPE (DeepSeek's interleaved pair layout, or the
half-split one with ``rope_interleave: false``; YaRN-scaled when configured) turns only the rotary
parts.

The cache keeps ``[c | k_rope]`` per token (``kv_lora_rank + qk_rope_head_dim`` elements, not the
expanded K/V: ``moe_runtime.layers.mla_cache``). Attention runs in the absorbed form: ``kv_b_proj``
splits per head into ``W_uk [nope, kv_lora]`` and ``W_uv [v, kv_lora]``; the query becomes
``[q_nope W_uk | q_rope]``, which dotted with a cached ``[c | k_rope]`` equals transformers'
``q_nope . (W_uk c) + q_rope . k_rope``. That is multi-query attention with one KV head of width
``kv_lora_rank + qk_rope_head_dim``, run by the GQA kernel of ``moe_runtime.layers.attention``
(decodes batched, prefill chunks padded, the blocks gathered once) with the cached row as key
and as value; the first
``kv_lora_rank`` output dims, times ``W_uv``, are the heads' values, then ``o_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import MLAShape
from moe_runtime.layers.attention import attention
from moe_runtime.layers.mla_cache import PagedMLACache
from moe_runtime.layers.norm import rms_norm
from moe_runtime.layers.yarn import softmax_scale, yarn_inv_freq

#: RMSNorm epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` (transformers' default, not the
#: config's ``rms_norm_eps``)
LATENT_NORM_EPS = 1e-6


class LatentRotary:
    """cos/sin tables ``[max_len, rope/2]`` (fp32 angles, YaRN's attention factor applied, then
    cast to ``dtype``) and their application to the rotary parts."""

    def __init__(
        self, shape: MLAShape, theta: float, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        dim = shape.qk_rope_head_dim
        if shape.yarn is None:
            inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)), 1.0
        else:
            inv_freq, factor = yarn_inv_freq(dim, theta, shape.yarn)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * factor).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * factor).to(dtype=dtype, device=device)
        self.interleave = shape.rope_interleave

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, rope]`` by ``positions [T]``. The interleaved layout comes out as
        ``[evens | odds]`` (transformers' V3 form; V2's complex form keeps pairs adjacent): a
        permutation applied to queries and keys alike, so their dot products are unchanged."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rope/2]
        sin = self.sin[positions].unsqueeze(1)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention:
    """MLA for every layer of a model; ``__call__`` is one layer's attention.

    Args:
        cfg: the model config (``cfg.mla`` set). max_len: positions RoPE covers.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        assert cfg.mla is not None
        self.cfg, self.shape = cfg, cfg.mla
        self.rotary = LatentRotary(cfg.mla, cfg.rope_theta, max_len, dtype, device)
        width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        # SDPA scales by width**-0.5; the model's scale is qk_head_dim**-0.5 (x YaRN's mscale**2)
        self.q_scale = softmax_scale(cfg.mla.qk_head_dim, cfg.mla.yarn) * math.sqrt(width)

    def __call__(
        self, x: torch.Tensor, w: dict[str, torch.Tensor], layer: int, cache: PagedMLACache, step
    ) -> torch.Tensor:
        """``x [T, H]`` (normed) -> the heads' values ``[T, heads * v_head_dim]``, before the o
        projection (the model applies it with the residual); writes the step's latents to
        ``cache`` at the step's slots (``step.slots``)."""
        s, heads, p = self.shape, self.cfg.num_heads, f"layers.{layer}."
        t, nope, rope, rank = x.shape[0], s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank
        if s.q_lora_rank:
            q_lat = rms_norm(
                F.linear(x, w[p + "q_a"], w.get(p + "q_a_bias")), w[p + "q_a_norm"], LATENT_NORM_EPS
            )
            q = F.linear(q_lat, w[p + "q_b"])
        else:
            q = F.linear(x, w[p + "q"])
        q_nope, q_rope = q.view(t, heads, s.qk_head_dim).split([nope, rope], dim=-1)
        c, k_rope = F.linear(x, w[p + "kv_a"], w.get(p + "kv_a_bias")).split([rank, rope], dim=-1)
        c = rms_norm(c, w[p + "kv_a_norm"], LATENT_NORM_EPS)
        q_rope = self.rotary.apply(q_rope, step.positions)
        k_rope = self.rotary.apply(k_rope.unsqueeze(1), step.positions)  # [T, 1, rope]
        kv_b = w[p + "kv_b"].view(heads, nope + s.v_head_dim, rank)
        q_abs = torch.einsum("thn,hnc->thc", q_nope, kv_b[:, :nope])  # [T, heads, rank]
        query = torch.cat((q_abs, q_rope), dim=-1) * self.q_scale
        latent = torch.cat((c.unsqueeze(1), k_rope), dim=-1)  # [T, 1, rank + rope]
        out = attention(query, latent, latent, layer, cache, step).view(t, heads, rank + rope)
        values = torch.einsum("thc,hvc->thv", out[..., :rank], kv_b[:, nope:])  # [T, heads, v]
        return values.reshape(t, heads * s.v_head_dim)  # the model applies o and the residual
