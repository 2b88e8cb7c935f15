"""MXFP4 (OCP microscaling): FP4 e2m1 values, two per byte, and one e8m0 scale byte per 32.

Stored as gpt-oss ships it: ``blocks`` uint8 ``[out, G, 16]`` (``G = ceil(in / 32)``; the low
nibble is the even element, the high nibble the odd one) and ``scales`` uint8 ``[out, G]`` (the
exponent plus 127). Dequantizing is transformers' ``integrations.mxfp4._convert_moe_packed_tensors``
step for step (a lookup of :data:`FP4_VALUES` in the target dtype, then ``ldexp`` by the
exponent), so the result is equal bit for bit. An ``in`` width that is not a multiple of 32 is
padded with zeros in the last group.
"""

from __future__ import annotations

import functools
import math

import torch

from moe_runtime.quant.codec import Codec, Component

GROUP = 32
#: e2m1 code -> value (transformers' ``FP4_VALUES``): codes 0-7 positive, 8-15 negative.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = torch.tensor(FP4_VALUES[:8])


def groups(inn: int) -> int:
    return -(-inn // GROUP)


@functools.cache
def _lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:data:`FP4_VALUES` as a ``[16]`` tensor, made once per dtype and device (on CUDA a copy)."""
    return torch.tensor(FP4_VALUES, dtype=dtype, device=device)


def unpack(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in ``dtype``."""
    lut = _lut(dtype, blocks.device)
    out = torch.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1), out=out)
    return out.flatten(-2)


class Mxfp4Codec(Codec):
    name = "mxfp4"
    row_scaled = True

    def components(self, out: int, inn: int) -> tuple[Component, ...]:
        g = groups(inn)
        return (
            Component("blocks", torch.uint8, (out, g, GROUP // 2)),
            Component("scales", torch.uint8, (out, g)),
        )

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, inn = w.shape
        g = groups(inn)
        x = torch.zeros((out, g * GROUP), dtype=torch.float32, device=w.device)
        x[:, :inn] = w.float()
        x = x.view(out, g, GROUP)
        amax = x.abs().amax(dim=-1)  # [out, G]
        # the largest e2m1 value is 6 = 1.5 * 2^2: an exponent of floor(log2(amax)) - 2 keeps amax <= 6
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
        biased = (exp + 127).clamp(0, 254)
        scaled = x / torch.exp2(biased - 127).unsqueeze(-1)
        mags = _MAGNITUDES.to(w.device)
        mid = (mags[1:] + mags[:-1]) / 2  # round to the nearest e2m1 magnitude
        idx = torch.bucketize(scaled.abs().clamp(max=6.0), mid, right=False)
        code = (idx | ((scaled < 0).to(torch.int64) << 3)).to(torch.uint8)
        blocks = code[..., 0::2] | (code[..., 1::2] << 4)
        return {"blocks": blocks, "scales": biased.to(torch.uint8)}

    def matrix_shape(self, parts: dict[str, torch.Tensor]) -> tuple[int, int]:
        blocks = parts["blocks"]
        return int(blocks.shape[-3]), int(blocks.shape[-2]) * GROUP

    def dequantize(
        self, parts: dict[str, torch.Tensor], out: int, inn: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return unpack(parts["blocks"], parts["scales"], dtype)[..., :inn]

    def surely_finite(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
        """e2m1 has no NaN or Inf, so every value is finite when the largest, 6 x 2^(largest
        scale - 127), is: one pass over the scales (1/16 of the bytes) instead of a dequantize."""
        top = int(parts["scales"].max()) - 127
        return math.ldexp(FP4_VALUES[7], top) <= torch.finfo(dtype).max

    def describe(self) -> str:
        return "mxfp4 (e2m1, e8m0 scale per 32)"
