"""Host expert store: every routed expert's weights packed into one contiguous host buffer.

Layout: a single tensor ``[L * E, 3 * I * H]`` (L MoE layers, E experts, I expert width, H hidden
size). Row ``l * E + e`` is expert ``(l, e)`` packed as ``[gate (I, H) | up (I, H) | down (H, I)]``
so that moving an expert is one contiguous copy and gate/up run as one fused matmul.
Quantized experts (a :class:`~moe_runtime.quant.ExpertLayout`) make the store ``[L * E, nbytes]``
uint8: row ``l * E + e`` is the expert's packed bytes (each matrix's quantized data and scales at
fixed offsets), still one contiguous copy.
The buffer is pinned (page-locked at exactly its size, :mod:`moe_runtime.pinned`) when the device
is a GPU, so copies to it are asynchronous DMA (MoE-Infinity §5.3, "pinned memory and DMA
operations").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from moe_runtime.errors import CheckpointError
from moe_runtime.pinned import pinned_empty

if TYPE_CHECKING:
    from moe_runtime.quant.layout import ExpertLayout

PARTS = ("gate", "up", "down")


class HostExpertStore:
    """Packed expert weights in host memory.

    Args:
        num_layers: MoE layers (L). num_experts: experts per layer (E).
        hidden_size: H. intermediate_size: I (one expert's MLP width).
        dtype: the runtime's compute dtype (the storage dtype of plain experts).
        pin_memory: page-lock the buffer (:func:`~moe_runtime.pinned.pinned_empty`; needs CUDA).
        layout: the packed row of quantized experts; None = plain ``[gate | up | down]`` in ``dtype``.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
        layout: ExpertLayout | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.compute_dtype = dtype
        self.layout = layout
        # row elements: weights of the three matrices, or a quantized expert's bytes
        self.expert_numel = layout.nbytes if layout else 3 * intermediate_size * hidden_size
        shape, stored = (num_layers * num_experts, self.expert_numel), torch.uint8 if layout else dtype
        # pinned at exactly its size (``torch.empty(pin_memory=True)`` rounds up to a power of two)
        self.data = pinned_empty(shape, stored) if pin_memory else torch.empty(shape, dtype=stored)
        self._filled = np.zeros((num_layers * num_experts, 3), dtype=bool)

    @property
    def plain_nbytes(self) -> int:
        """Bytes one expert takes unquantized in the compute dtype (the summary's "before")."""
        return (
            3
            * self.intermediate_size
            * self.hidden_size
            * torch.empty((), dtype=self.compute_dtype).element_size()
        )

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one packed expert (the unit every transfer moves)."""
        return self.expert_numel * self.data.element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def mark_filled(self) -> None:
        """Every matrix counts as written (``data`` was filled whole, e.g. by
        ``moe_runtime.dummy_weights``), so :meth:`check_complete` passes."""
        self._filled[:] = True

    def key(self, layer: int, expert: int) -> int:
        """Flat expert key ``layer * E + expert`` used by the buffer and I/O queue."""
        return layer * self.num_experts + expert

    def expert(self, key: int) -> torch.Tensor:
        """1-D host view of the packed expert with flat key ``key``."""
        return self.data[key]

    def _check(
        self, layer: int, expert: int, shape: tuple[int, ...], want: tuple[int, ...], source: str
    ) -> None:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise CheckpointError(
                f"{source}: expert ({layer}, {expert}) is out of range "
                f"(L={self.num_layers}, E={self.num_experts})"
            )
        if tuple(shape) != want:
            raise CheckpointError(f"{source}: expected shape {list(want)}, found {list(shape)}")

    def write(self, layer: int, expert: int, part: str, tensor: torch.Tensor, source: str) -> torch.Tensor:
        """Copy one float checkpoint matrix into its place, checking its shape; quantized experts
        quantize it first (once, at load).

        Returns:
            The weight as it will be served: a view of the store in its dtype, shaped like
            ``tensor`` (plain), or the stored matrix dequantized to the compute dtype.

        Raises:
            CheckpointError: wrong shape or an expert index out of range (names ``source``).
        """
        h, i = self.hidden_size, self.intermediate_size
        want = (h, i) if part == "down" else (i, h)
        self._check(layer, expert, tuple(tensor.shape), want, source)
        key = self.key(layer, expert)
        row = self.data[key]
        if self.layout is not None:
            for name, value in self.layout.codec.quantize(tensor).items():
                self.layout.write(row, part, name, value)
            self._filled[key, PARTS.index(part)] = True
            return self.layout.dequant(row, part, self.compute_dtype)
        start = PARTS.index(part) * i * h
        dst = row[start : start + i * h].view(want)
        dst.copy_(tensor)
        self._filled[key, PARTS.index(part)] = True
        return dst

    def write_stored(
        self, layer: int, expert: int, part: str, parts: dict[str, torch.Tensor], source: str
    ) -> None:
        """Copy one matrix already in the store's format (a quantized checkpoint's weight and
        scales, by component name) into its place, checking each component's dtype and shape.

        Raises:
            CheckpointError: no layout, an expert out of range, a wrong dtype or shape (names ``source``).
        """
        if self.layout is None:
            raise CheckpointError(f"{source}: quantized, but the experts are kept unquantized")
        row = self.data[self.key(layer, expert)]
        for name, value in parts.items():
            _, comp = self.layout.offsets[(part, name)]
            self._check(layer, expert, tuple(value.shape), comp.shape, f"{source} ({name})")
            if value.dtype != comp.dtype:
                got, want = (str(d).removeprefix("torch.") for d in (value.dtype, comp.dtype))
                raise CheckpointError(f"{source}: {name} has dtype {got}, expected {want}")
            self.layout.write(row, part, name, value)
        self._filled[self.key(layer, expert), PARTS.index(part)] = True

    def dequant(self, layer: int, expert: int, part: str) -> torch.Tensor:
        """One stored matrix as served (compute dtype): for the load checks and tests."""
        row = self.data[self.key(layer, expert)]
        if self.layout is not None:
            return self.layout.dequant(row, part, self.compute_dtype)
        h, i = self.hidden_size, self.intermediate_size
        start = PARTS.index(part) * i * h
        return row[start : start + i * h].view((h, i) if part == "down" else (i, h))

    def check_complete(self, describe) -> None:
        """Raise :class:`CheckpointError` naming the first expert tensor never written.

        ``describe(layer, expert, part) -> str`` renders the checkpoint's tensor name.
        """
        missing = np.argwhere(~self._filled)
        if len(missing):
            key, part = int(missing[0][0]), int(missing[0][1])
            layer, expert = divmod(key, self.num_experts)
            raise CheckpointError(
                f"missing tensor {describe(layer, expert, PARTS[part])} "
                f"({len(missing)} expert tensors missing)"
            )
