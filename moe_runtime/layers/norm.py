"""RMSNorm, computed in fp32 and cast back like the reference implementations; LayerNorm with a bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``x`` is ``[..., D]``."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with a bias over the last dim of ``x [..., D]``, in ``x``'s dtype like
    ``torch.nn.LayerNorm`` (Phi-3.5-MoE's decoder and final norms)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def decoder_norm(
    x: torch.Tensor, w: dict[str, torch.Tensor], name: str, kind: str, eps: float
) -> torch.Tensor:
    """The norm ``name`` (canonical weight name; a LayerNorm's bias is ``name + "_bias"``) of kind
    ``rms`` or ``layer`` (``ModelConfig.norm``) applied to ``x [..., D]``."""
    if kind == "layer":
        return layer_norm(x, w[name], w[name + "_bias"], eps)
    return rms_norm(x, w[name], eps)
