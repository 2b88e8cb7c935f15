"""RMSNorm, computed in fp32 and cast back like the reference implementations; LayerNorm with a bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: device type -> whether ATen's one-kernel RMSNorm runs there (probed once per device type)
_FUSED: dict[str, bool] = {}


def _fused_runs(device: torch.device) -> bool:
    ok = _FUSED.get(device.type)
    if ok is None:
        try:
            torch.ops.aten._fused_rms_norm(torch.ones(1, 8, device=device), [8], None, 1e-6)
            ok = True
        except (AttributeError, NotImplementedError, RuntimeError):
            ok = False
        _FUSED[device.type] = ok
    return ok


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``x`` is ``[..., D]``.

    The normalisation runs in fp32 and is cast back before the weight, as transformers' RMSNorm
    does. Where ATen's fused kernel runs, the fp32 part is one kernel instead of five (pow, mean,
    add, rsqrt, mul): on a GPU each kernel launch costs host time, and a Qwen3 decoder layer
    normalises four times (its input, after attention, the queries' and the keys' heads).
    """
    dtype = x.dtype
    h = x.float()
    if _fused_runs(h.device):
        h = torch.ops.aten._fused_rms_norm(h, [h.shape[-1]], None, eps)[0]
    else:
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
