"""Rotary position embedding (RoPE) with a cos/sin table built once: the default type, partial
rotary (only the leading ``rotary_dim`` dims of a head turn, GLM-4.5), YaRN (gpt-oss) and LongRoPE
(Phi-3.5-MoE).

LongRoPE as transformers 5's ``PhimoeRotaryEmbedding`` computes it: inverse frequencies divided by
the ``short_factor`` list, cos/sin multiplied by ``short_mscale`` while a forward call's largest
position + 1 is at most ``original_max_position_embeddings``, else by ``long_mscale``. Within the
original context (all that the tests check) our table equals transformers' bit for bit. Beyond it
the table applies that rule per position: a token at position ``>= original`` gets
``long_mscale``, an earlier one ``short_mscale``, which equals transformers for every decode step
of one sequence but not for a prefill chunk that crosses the boundary (transformers scales the
whole call by ``long_mscale``; a per-call rule cannot be batched). transformers 5's Phimoe forward
never uses ``long_factor`` (it recomputes the inverse frequencies without a sequence length), and
neither do we; the original Phi-3 code switches to it beyond the original context.
"""

from __future__ import annotations

import torch

from moe_runtime.config_types import LongRoPE, YarnScaling
from moe_runtime.layers.yarn import yarn_inv_freq


class Rotary:
    """Precomputed ``cos``/``sin`` tables ``[max_len, rotary_dim]`` for positions ``0..max_len-1``.

    Values match the reference: inverse frequencies and angles in fp32, then cast to ``dtype``.
    ``rotary_dim`` (default ``head_dim``): the leading dims of each head that turn, the rest pass
    through (transformers' ``apply_rotary_pos_emb`` with a partial ``cos``).
    With ``yarn`` (gpt-oss) the inverse frequencies and the cos/sin factor are YaRN's
    (:func:`moe_runtime.layers.yarn.yarn_inv_freq`, transformers' ``_compute_yarn_parameters``).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
        longrope: LongRoPE | None = None,
        yarn: YarnScaling | None = None,
    ) -> None:
        dim = rotary_dim or head_dim
        self.dim = dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        factor = 1.0
        if yarn is not None:
            inv_freq, factor = yarn_inv_freq(dim, theta, yarn)
        elif longrope is None:
            inv_freq = 1.0 / (theta**exponent)
        else:
            inv_freq = 1.0 / (torch.tensor(longrope.short_factor, dtype=torch.float32) * theta**exponent)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if longrope is not None:  # transformers' per-call rule, applied per position (module doc)
            beyond = pos[:, None] + 1 > longrope.original_max_position_embeddings
            scale = torch.where(beyond, longrope.long_mscale, longrope.short_mscale)
            cos, sin = cos * scale, sin * scale
        if yarn is not None:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by the angles of ``positions [T]``."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1)
        if self.dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        d = self.dim
        return tuple(
            torch.cat((z[..., :d] * cos + _rotate_half(z[..., :d]) * sin, z[..., d:]), dim=-1) for z in (q, k)
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
