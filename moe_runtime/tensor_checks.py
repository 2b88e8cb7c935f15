"""Checks on each weight tensor as it is read: a float dtype, and finite values.

A weight stored as ``int8``/``bool``/``fp8`` outside a quantized checkpoint is quantized without
its scales or corrupt: casting it to the runtime dtype would serve garbage, so it is refused. The
quantized weights of an fp8 block-scaled (or a family's MXFP4) checkpoint never reach this check:
:class:`~moe_runtime.quant.checkpoint.QuantPairs` checks their dtype and shape with their scales,
and their finiteness is checked on the dequantized weight, as served. A NaN or Inf weight would
load and then poison the logits of the first request that reaches it, so it is refused at load
time, naming the tensor.

The finiteness scan is one ``torch.aminmax`` reduction of the tensor as stored for serving (after
the cast to the runtime dtype): NaN propagates to both results, an Inf shows as the min or max, and
the reduction allocates nothing, so it runs at memory bandwidth (``torch.isfinite(t).all()``
writes a bool per element and is many times slower on CPU). Checking after the cast also catches
finite values that overflow the runtime dtype (an fp32 weight of 1e5 in fp16).
"""

from __future__ import annotations

import math

import torch

from moe_runtime.errors import CheckpointError

#: Stored dtypes a float weight may have; it is cast to the runtime dtype on load.
FLOAT_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_weight_dtype(tensor: torch.Tensor, source: str) -> None:
    """Refuse a weight whose stored dtype is not a float we can cast from.

    Raises:
        CheckpointError: ``"<source> has dtype int8; ..."``.
    """
    if tensor.dtype not in FLOAT_WEIGHT_DTYPES:
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise CheckpointError(
            f"{source} has dtype {dtype}; weights must be float32, bfloat16, float16 or float64, or "
            "quantized with their scales under a quantization_config (fp8 block-scaled, mxfp4)"
        )


def check_finite(loaded: torch.Tensor, stored: torch.Tensor, source: str) -> None:
    """Refuse a weight with a NaN or Inf value.

    Args:
        loaded: the weight as it will be served (runtime dtype, on its device), any shape.
        stored: the same weight as read from the file (to tell a non-finite value in the file from
            an overflow in the cast).
        source: ``"<file>: tensor <name>"`` for the message.

    Raises:
        CheckpointError: naming ``source`` and whether the file holds NaN/Inf or the cast overflowed.
    """
    if loaded.numel() == 0:
        return
    lo, hi = torch.aminmax(loaded)
    if math.isfinite(lo.item()) and math.isfinite(hi.item()):  # ~3 µs on a small CPU tensor
        return
    if loaded.dtype != stored.dtype:
        s_lo, s_hi = torch.aminmax(stored)
        if bool(torch.isfinite(s_lo) & torch.isfinite(s_hi)):
            dtype = str(loaded.dtype).removeprefix("torch.")
            raise CheckpointError(
                f"{source} has values up to {max(abs(float(s_lo)), abs(float(s_hi))):.3g}, which "
                f"overflow {dtype}; load it with a wider --dtype (bf16 or fp32)"
            )
    nan = bool(torch.isnan(stored).any())
    raise CheckpointError(f"{source} contains {'NaN' if nan else 'Inf'} values; the checkpoint is corrupt")
