"""Quantized experts: weight formats (one file each: ``fp8`` block-scaled, ``int8`` per channel,
``mxfp4`` microscaled, ``cast`` plain floats in another dtype), the packed expert row
(``layout``), the format choice (``select``) and the pairing of a checkpoint's quantized tensors
with their scales (``checkpoint``)."""

from moe_runtime.quant.layout import DequantSlots, ExpertLayout
from moe_runtime.quant.select import EXPERT_DTYPES, expert_codec, expert_layout, parse_quantization

__all__ = [
    "DequantSlots",
    "ExpertLayout",
    "EXPERT_DTYPES",
    "expert_codec",
    "expert_layout",
    "parse_quantization",
]
