"""Rotary position embedding (RoPE), default type, with a cos/sin table built once."""

from __future__ import annotations

import torch


class Rotary:
    """Precomputed ``cos``/``sin`` tables ``[max_len, head_dim]`` for positions ``0..max_len-1``.

    Values match the reference: inverse frequencies and angles in fp32, then cast to ``dtype``.
    """

    def __init__(
        self, head_dim: int, theta: float, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

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
