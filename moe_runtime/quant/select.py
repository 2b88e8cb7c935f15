"""Which expert format a model is served in: the checkpoint's ``quantization_config`` and
``--expert-dtype`` decide it."""

from __future__ import annotations

from typing import Any

import torch

from moe_runtime.config import DTYPES, EXPERT_DTYPES
from moe_runtime.errors import ConfigError
from moe_runtime.quant.cast import CastCodec
from moe_runtime.quant.codec import Codec
from moe_runtime.quant.fp8 import Fp8BlockCodec, block_for
from moe_runtime.quant.int8 import Int8ChannelCodec
from moe_runtime.quant.layout import ExpertLayout
from moe_runtime.quant.mxfp4 import Mxfp4Codec

#: ``quantization_config.quant_method`` values a checkpoint may have.
CHECKPOINT_METHODS = ("fp8", "mxfp4")


def parse_quantization(raw: dict[str, Any]) -> tuple[str | None, tuple[int, int] | None]:
    """``(quant_method, weight_block_size)`` of a ``config.json`` (``(None, None)`` unquantized).

    Raises:
        ConfigError: naming the field: a ``quantization_config`` that is not an object, a
            ``quant_method`` not in :data:`CHECKPOINT_METHODS`, an fp8 config without a
            ``weight_block_size`` of two positive integers (per-tensor fp8 is not supported) or
            with an ``fmt`` other than ``e4m3``.
    """
    q = raw.get("quantization_config")
    if q is None:
        return None, None
    if not isinstance(q, dict):
        raise ConfigError("quantization_config must be an object")
    method = q.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(
            f"quantization_config.quant_method {method!r} is not supported "
            f"(supported: {', '.join(CHECKPOINT_METHODS)})"
        )
    if method != "fp8":
        return method, None
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(type(b) is int and 1 <= b <= 1 << 16 for b in block)
    ):
        raise ConfigError(
            f"quantization_config.weight_block_size must be two integers in [1, 65536] "
            f"(per-tensor fp8 is not supported), got {block!r}"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt must be e4m3, got {q.get('fmt')!r}")
    return method, (block[0], block[1])


def checkpoint_codec(method: str | None, block: tuple[int, int] | None) -> Codec | None:
    """The codec of a checkpoint's quantized tensors (None: unquantized)."""
    if method == "fp8":
        assert block is not None
        return Fp8BlockCodec(block)
    return Mxfp4Codec() if method == "mxfp4" else None


def expert_codec(
    expert_dtype: str,
    compute: torch.dtype,
    method: str | None,
    block: tuple[int, int] | None,
    hidden: int,
    intermediate: int,
) -> Codec | None:
    """The format experts are kept in (host store, link, slots); None = plain, in ``compute``.

    ``auto``: the checkpoint's own format; ``fp8`` on an unquantized checkpoint: blocks of
    :func:`~moe_runtime.quant.fp8.block_for` (128 x 128, smaller for narrow experts); a float
    dtype equal to ``compute``: plain."""
    if expert_dtype == "auto":
        return checkpoint_codec(method, block)
    if expert_dtype in ("bf16", "fp16", "fp32"):
        dtype = DTYPES[expert_dtype]
        return None if dtype == compute else CastCodec(dtype, expert_dtype)
    if expert_dtype == "fp8":
        return Fp8BlockCodec(block if method == "fp8" and block else block_for(hidden, intermediate))
    if expert_dtype == "int8":
        return Int8ChannelCodec()
    if expert_dtype == "mxfp4":
        return Mxfp4Codec()
    raise ConfigError(f"--expert-dtype must be one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")


def expert_layout(cfg: Any, runtime: Any) -> ExpertLayout | None:
    """The packed expert row of ``cfg`` (a ModelConfig) under ``runtime`` (a RuntimeConfig); None
    for plain experts (rows of ``3 * I * H`` elements of the compute dtype)."""
    codec = expert_codec(
        runtime.expert_dtype,
        runtime.torch_dtype,
        cfg.quant_method,
        cfg.weight_block_size,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
    )
    return ExpertLayout(codec, cfg.hidden_size, cfg.moe_intermediate_size) if codec else None
