"""YaRN rope scaling (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2/V3 and gpt-oss use it.

Inverse frequencies blend interpolated (``/ factor``) and original ones with a linear ramp over the
rotary dimensions between the correction dims of ``beta_fast`` and ``beta_slow`` rotations; the
cos/sin tables are multiplied by an attention factor, and DeepSeek also multiplies the softmax
scale by ``mscale(factor, mscale_all_dim)**2``. Formulas equal transformers'
``_compute_yarn_parameters`` and ``yarn_apply_mscale`` (DeepSeek modeling files); gpt-oss sets
``truncate: false`` and no mscale.
"""

from __future__ import annotations

import math

import torch

from moe_runtime.config_types import YarnScaling


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, y: YarnScaling) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] fp32, attention factor)`` for a rotary width of ``dim``."""
    attention = y.attention_factor
    if attention is None:
        if y.mscale and y.mscale_all_dim:
            attention = _mscale(y.factor, y.mscale) / _mscale(y.factor, y.mscale_all_dim)
        else:
            attention = _mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def softmax_scale(head_dim: int, y: YarnScaling | None) -> float:
    """Attention softmax scale: ``head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2``
    under YaRN when ``mscale_all_dim`` is set (DeepSeek's ``yarn_apply_mscale``)."""
    scale = head_dim**-0.5
    if y is not None and y.mscale_all_dim:
        m = _mscale(y.factor, y.mscale_all_dim)
        scale = scale * m * m
    return scale
