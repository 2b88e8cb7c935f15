"""Rotary position embedding (RoPE), default or YaRN-scaled, with a cos/sin table built once."""

from __future__ import annotations

import torch

from moe_runtime.layers.yarn import YarnScaling, yarn_inv_freq


class Rotary:
    """Precomputed ``cos``/``sin`` tables ``[max_len, head_dim]`` for positions ``0..max_len-1``.

    Values match the reference: inverse frequencies and angles in fp32, then cast to ``dtype``.
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
        yarn: YarnScaling | None = None,
    ) -> None:
        if yarn is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        else:
            inv_freq, factor = yarn_inv_freq(head_dim, theta, yarn)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if yarn is not None:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by the angles of ``positions [T]``."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
