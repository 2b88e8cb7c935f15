"""Host expert store: every routed expert's weights packed into one contiguous host buffer.

Layout: a single tensor ``[L * E, 3 * I * H]`` (L MoE layers, E experts, I expert width, H hidden
size). Row ``l * E + e`` is expert ``(l, e)`` packed as ``[gate (I, H) | up (I, H) | down (H, I)]``
so that moving an expert is one contiguous copy and gate/up run as one fused matmul.
The buffer is pinned when CUDA is present so copies to the device are asynchronous DMA
(MoE-Infinity §5.3, "pinned memory and DMA operations").
"""

from __future__ import annotations

import numpy as np
import torch

from moe_runtime.errors import CheckpointError

PARTS = ("gate", "up", "down")


class HostExpertStore:
    """Packed expert weights in host memory.

    Args:
        num_layers: MoE layers (L). num_experts: experts per layer (E).
        hidden_size: H. intermediate_size: I (one expert's MLP width).
        dtype: storage dtype (the runtime's compute dtype).
        pin_memory: page-lock the buffer (only meaningful with CUDA).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.expert_numel = 3 * intermediate_size * hidden_size
        self.data = torch.empty(
            (num_layers * num_experts, self.expert_numel), dtype=dtype, pin_memory=pin_memory
        )
        self._filled = np.zeros((num_layers * num_experts, 3), dtype=bool)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one packed expert (the unit every transfer moves)."""
        return self.expert_numel * self.data.element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def key(self, layer: int, expert: int) -> int:
        """Flat expert key ``layer * E + expert`` used by the buffer and I/O queue."""
        return layer * self.num_experts + expert

    def expert(self, key: int) -> torch.Tensor:
        """1-D host view of the packed expert with flat key ``key``."""
        return self.data[key]

    def write(self, layer: int, expert: int, part: str, tensor: torch.Tensor, source: str) -> torch.Tensor:
        """Copy one checkpoint matrix into its place, checking its shape.

        Returns:
            The destination: a view of the store in its dtype, shaped like ``tensor``.

        Raises:
            CheckpointError: wrong shape or an expert index out of range (names ``source``).
        """
        h, i = self.hidden_size, self.intermediate_size
        want = (h, i) if part == "down" else (i, h)
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise CheckpointError(
                f"{source}: expert ({layer}, {expert}) is out of range "
                f"(L={self.num_layers}, E={self.num_experts})"
            )
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{source}: expected shape {list(want)}, found {list(tensor.shape)}")
        row = self.data[self.key(layer, expert)]
        start = PARTS.index(part) * i * h
        dst = row[start : start + i * h].view(want)
        dst.copy_(tensor)
        self._filled[self.key(layer, expert), PARTS.index(part)] = True
        return dst

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
