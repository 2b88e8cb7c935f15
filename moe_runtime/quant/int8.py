"""int8 with one fp32 scale per output channel (row): ``weight`` int8 ``[out, in]``,
``weight_scale`` float32 ``[out, 1]``; the float weight is ``weight * weight_scale``. Quantizing
maps each row's absolute maximum to 127 (symmetric, round to nearest)."""

from __future__ import annotations

import torch

from moe_runtime.quant.codec import Codec, Component


class Int8ChannelCodec(Codec):
    name = "int8"
    row_scaled = True

    def components(self, out: int, inn: int) -> tuple[Component, ...]:
        return (
            Component("weight", torch.int8, (out, inn)),
            Component("weight_scale", torch.float32, (out, 1)),
        )

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        w = w.float()
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}

    def dequantize(
        self, parts: dict[str, torch.Tensor], out: int, inn: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return (parts["weight"].to(torch.float32) * parts["weight_scale"]).to(dtype)

    def describe(self) -> str:
        return "int8 per output channel"
