"""Reading a quantized checkpoint: a quantized weight and its scales are separate tensors (any
order, any shard); :class:`QuantPairs` collects them until a matrix is complete.

Names: fp8 block-scaled (DeepSeek-V3, Qwen3-*-FP8) stores ``<name>.weight`` (float8_e4m3fn) next to
``<name>.weight_scale_inv`` (float32); a family may declare other suffixes per method
(``Family.quantized_suffixes``); MXFP4's ``<name>_blocks`` / ``<name>_scales`` (gpt-oss) are the
defaults. The base name is then classified like an unquantized weight.
"""

from __future__ import annotations

import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.quant.codec import Codec

#: Component name -> suffix on the base tensor name, per checkpoint method. An empty suffix: the
#: base name itself holds that component (fp8's ``.weight``), recognised by its stored dtype.
DEFAULT_SUFFIXES: dict[str, dict[str, str]] = {
    "fp8": {"weight": "", "weight_scale_inv": "_scale_inv"},
    "mxfp4": {"blocks": "_blocks", "scales": "_scales"},
}


class QuantPairs:
    """Collects the components of each quantized matrix of a checkpoint.

    Args:
        codec: the checkpoint's format (:func:`~moe_runtime.quant.select.checkpoint_codec`).
        suffixes: component name -> name suffix (:data:`DEFAULT_SUFFIXES` or the family's).
    """

    def __init__(self, codec: Codec, suffixes: dict[str, str]) -> None:
        self.codec, self.suffixes = codec, suffixes
        self._dtypes = {c.name: c.dtype for c in codec.components(1, 1)}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def component(self, name: str, dtype: torch.dtype) -> tuple[str, str] | None:
        """``(base name, component)`` when tensor ``name`` of stored ``dtype`` is a piece of a
        quantized matrix, else None (an unquantized tensor: norms, embeddings, routers)."""
        for comp, suffix in self.suffixes.items():
            if suffix and name.endswith(suffix):
                return name[: -len(suffix)], comp
        for comp, suffix in self.suffixes.items():
            if not suffix and dtype == self._dtypes[comp] and dtype.is_floating_point and dtype.itemsize == 1:
                return name, comp
        return None

    def add(self, base: str, comp: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Keep one component; all of the matrix's components once the last one arrives."""
        parts = self._pending.setdefault(base, {})
        parts[comp] = tensor
        if len(parts) < len(self.suffixes):
            return None
        return self._pending.pop(base)

    def check_complete(self) -> None:
        """Raise :class:`CheckpointError` naming the first missing component tensor."""
        for base, parts in self._pending.items():
            missing = [c for c in self.suffixes if c not in parts]
            have = ", ".join(base + self.suffixes[c] for c in parts)
            raise CheckpointError(
                f"missing tensor {base + self.suffixes[missing[0]]} (the checkpoint has {have}; "
                f"{len(self._pending)} quantized weights incomplete)"
            )

    def check_stored(self, parts: dict[str, torch.Tensor], source: str) -> tuple[int, int, tuple[int, ...]]:
        """``(out, in, leading dims)`` of a complete matrix after checking each component's dtype
        and shape (any equal leading dims, e.g. ``(E,)`` for stacked experts).

        Raises:
            CheckpointError: ``"<source>: <component> has dtype ..."`` or ``"... expected shape"``.
        """
        out, inn = self.codec.matrix_shape(parts)
        lead = None
        for comp in self.codec.components(out, inn):
            t = parts[comp.name]
            if t.dtype != comp.dtype:
                got = str(t.dtype).removeprefix("torch.")
                want = str(comp.dtype).removeprefix("torch.")
                raise CheckpointError(f"{source}: {comp.name} has dtype {got}, expected {want}")
            n = len(comp.shape)
            if tuple(t.shape[t.dim() - n :]) != comp.shape or (
                lead is not None and tuple(t.shape[:-n]) != lead
            ):
                want_shape = [*(lead or ()), *comp.shape]
                raise CheckpointError(
                    f"{source}: {comp.name} expected shape {want_shape}, found {list(t.shape)}"
                )
            lead = tuple(t.shape[:-n])
        return out, inn, lead or ()

    def dequantize(
        self, parts: dict[str, torch.Tensor], source: str, width: int | None = None
    ) -> torch.Tensor:
        """A complete matrix as float32 ``[..., out, in]`` (dense weights and formats the experts
        are not kept in), its components checked first. ``width``: the ``in`` the config implies,
        when the format pads it (MXFP4 stores whole groups of 32): the padding is cropped."""
        out, inn, _ = self.check_stored(parts, source)
        if width is not None and inn - 32 < width < inn:
            inn = width
        return self.codec.dequantize(parts, out, inn, torch.float32).contiguous()
