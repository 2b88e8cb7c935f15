"""What an expert weight format is: the stored tensors of one ``[out, in]`` matrix and the two
conversions (float -> stored, stored -> float).

A :class:`Codec` describes one matrix as named components (``weight`` and its scales), each a
fixed dtype and shape, so a packed expert row (:mod:`moe_runtime.quant.layout`) can hold them at
fixed byte offsets. ``dequantize`` takes the components with any leading batch dimensions
(``[..., *shape]``) so several slots dequantize in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Component:
    """One stored tensor of a matrix: ``name`` is its checkpoint suffix (``weight``,
    ``weight_scale_inv``, ``blocks`` ...), ``dtype`` and ``shape`` its stored form."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


class Codec:
    """A weight format. ``name``: the ``--expert-dtype`` value that selects it. ``row_scaled``:
    every output row has its own scales (or none), so any subset of a matrix's rows, taken from
    each component, is that sub-matrix in the same format (fused experts split without
    dequantizing); block scales spanning rows (fp8) do not allow it."""

    name: str = ""
    row_scaled: bool = False

    def components(self, out: int, inn: int) -> tuple[Component, ...]:  # pragma: no cover - abstract
        """The stored tensors of an ``[out, in]`` matrix, in packing order."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        """``w [out, in]`` float -> its components by name (on ``w``'s device)."""
        raise NotImplementedError

    def dequantize(
        self, parts: dict[str, torch.Tensor], out: int, inn: int, dtype: torch.dtype
    ) -> torch.Tensor:  # pragma: no cover - abstract
        """Components with leading dims ``[...]`` -> ``[..., out, in]`` in ``dtype``."""
        raise NotImplementedError

    def matrix_shape(self, parts: dict[str, torch.Tensor]) -> tuple[int, int]:
        """``(out, in)`` of stored components (any leading dims): the first component's last two
        dims; formats that pack several values per element override it."""
        first = parts[self.components(1, 1)[0].name]
        return int(first.shape[-2]), int(first.shape[-1])

    def surely_finite(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
        """True when the stored components cannot dequantize to a NaN or Inf in ``dtype``, known
        without dequantizing (the load check then skips that); False: dequantize and look."""
        return False

    def describe(self) -> str:
        """Short text for summaries (``fp8 e4m3 block [128, 128]``)."""
        return self.name


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, out: int, inn: int) -> torch.Tensor:
    """A per-block scale ``[..., ceil(out/rows), ceil(in/cols)]`` repeated over its blocks and
    cropped to ``[..., out, in]``."""
    return scale.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)[..., :out, :inn]
