"""Plain experts stored in another float dtype than the compute dtype (``--expert-dtype bf16``
with ``--dtype fp32``): no scales, dequantizing is a cast."""

from __future__ import annotations

import torch

from moe_runtime.quant.codec import Codec, Component


class CastCodec(Codec):
    """Args: dtype: the stored float dtype; name: its ``--expert-dtype`` name."""

    row_scaled = True

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype, self.name = dtype, name

    def components(self, out: int, inn: int) -> tuple[Component, ...]:
        return (Component("weight", self.dtype, (out, inn)),)

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": w.to(self.dtype)}

    def dequantize(
        self, parts: dict[str, torch.Tensor], out: int, inn: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return parts["weight"].to(dtype)
