"""RMSNorm, computed in fp32 and cast back like the reference implementations; LayerNorm with a bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: device type -> whether ATen's one-kernel RMSNorm runs there (probed once per device type)
_FUSED: dict[str, bool] = {}
#: device type -> whether the normalisation uses ATen's ``_fused_rms_norm`` where it runs. CUDA: one
#: kernel instead of five. CPU: that op is a composite of about nine ops there (casts, ``pow``,
#: ``mean``, ``add_``, ``rsqrt``, ``mul``), costlier than the five-op form below (see
#: ``docs/architecture.md``, host time per decode step), so the CPU runs the five ops unless a test
#: asks for the GPU's op stream.
PREFER_FUSED: dict[str, bool] = {"cpu": False}


def _fused_runs(device: torch.device) -> bool:
    if not PREFER_FUSED.get(device.type, True):
        return False
    ok = _FUSED.get(device.type)
    if ok is None:
        try:
            torch.ops.aten._fused_rms_norm(torch.ones(1, 8, device=device), [8], None, 1e-6)
            ok = True
        except (AttributeError, NotImplementedError, RuntimeError):
            ok = False
        _FUSED[device.type] = ok
    return ok


def normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim of ``x [..., D]``, in fp32, cast back to
    ``x``'s dtype (transformers' RMSNorm before its weight). The fused kernel takes ``x`` in its
    own dtype and computes in fp32 inside: one op instead of a cast, the kernel and a cast back."""
    if _fused_runs(x.device):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)[0]
    h = x if x.dtype == torch.float32 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h if h.dtype == x.dtype else h.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``x`` is ``[..., D]``.

    The normalisation runs in fp32 and is cast back before the weight, as transformers' RMSNorm
    does (:func:`normalise`); where the fused kernel runs, a ``[D]`` weight goes into the kernel
    (one op). ``out``: written there (e.g. the query and key heads inside the fused q/k/v
    projection's output), else a new tensor.
    """
    if out is None and weight.dim() == 1 and _fused_runs(x.device):
        # one kernel with the weight: the product is rounded once, where the reference rounds
        # the normalised value to the model dtype first (the same in fp32 up to the kernel's order)
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    h = normalise(x, eps)
    if out is None:
        return weight * h
    if torch.compiler.is_compiling():  # the compiler takes no strided ``out=``: the same write
        return out.copy_(weight * h)
    return torch.mul(weight, h, out=out)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with a bias over the last dim of ``x [..., D]``, in ``x``'s dtype like
    ``torch.nn.LayerNorm`` (Phi-3.5-MoE's decoder and final norms)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
