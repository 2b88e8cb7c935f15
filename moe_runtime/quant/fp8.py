"""FP8 e4m3 with one fp32 scale per ``[rows, cols]`` block, as DeepSeek-V3 and Qwen3-*-FP8 ship it.

Stored: ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` float32
``[ceil(out / rows), ceil(in / cols)]``; the float weight is ``weight * weight_scale_inv`` of its
block (DeepSeek-V3's ``weight_dequant``, transformers' ``FP8Linear`` dequantization). Quantizing
scales each block's absolute maximum to e4m3's largest value, 448.
"""

from __future__ import annotations

import torch

from moe_runtime.quant.codec import Codec, Component, expand_blocks

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def block_for(*widths: int, largest: int = 128) -> tuple[int, int]:
    """The square block ``--expert-dtype fp8`` uses: ``largest`` (128, DeepSeek-V3's and Qwen3's),
    or the largest power of two not above the smallest width, so a small matrix still gets
    several blocks."""
    side = largest
    while side > 1 and side > min(widths):
        side //= 2
    return side, side


class Fp8BlockCodec(Codec):
    """Args: block: ``(rows, cols)`` of one scale block (``weight_block_size``)."""

    name = "fp8"

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = (int(block[0]), int(block[1]))

    def components(self, out: int, inn: int) -> tuple[Component, ...]:
        r, c = self.block
        return (
            Component("weight", E4M3, (out, inn)),
            Component("weight_scale_inv", torch.float32, (-(-out // r), -(-inn // c))),
        )

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, inn = w.shape
        r, c = self.block
        w = w.float()
        pad = torch.zeros((-(-out // r) * r, -(-inn // c) * c), dtype=torch.float32, device=w.device)
        pad[:out, :inn] = w
        amax = pad.unflatten(0, (-1, r)).unflatten(2, (-1, c)).abs().amax(dim=(1, 3))  # [out/r, in/c]
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = (w / expand_blocks(scale, r, c, out, inn)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return {"weight": q, "weight_scale_inv": scale}

    def dequantize(
        self, parts: dict[str, torch.Tensor], out: int, inn: int, dtype: torch.dtype
    ) -> torch.Tensor:
        r, c = self.block
        q, scale = parts["weight"], parts["weight_scale_inv"]
        if out % r == 0 and inn % c == 0:  # whole blocks: broadcast the scales, no expanded copy
            blocks = q.to(torch.float32).unflatten(-1, (inn // c, c)).unflatten(-3, (out // r, r))
            w = (blocks * scale.unsqueeze(-1).unsqueeze(-3)).flatten(-2).flatten(-3, -2)
        else:
            w = q.to(torch.float32) * expand_blocks(scale, r, c, out, inn)
        return w.to(dtype)

    def describe(self) -> str:
        return f"fp8 e4m3 block {list(self.block)}"
