"""A quantized expert packed into one byte row: ``[gate | up | down]``, each matrix's components
(quantized data, then scales) at fixed, 16-byte aligned offsets, so moving an expert is still one
contiguous copy and a slot row reads back without any index.

:class:`ExpertLayout` maps the row; :class:`DequantSlots` gives a partition's slots the same
interface as the plain strided views (``part.gate_up[s]`` ``[2I, H]``, ``part.gate_up_t[a:b]``
``[n, H, 2I]``, ...) by dequantizing the slots asked for into a fresh tensor of the compute dtype
(a scratch the caller drops after its matmul).
"""

from __future__ import annotations

import torch

from moe_runtime.quant.codec import Codec, Component

ALIGN = 16  # bytes: every component starts aligned (fp32 scales need 4, CUDA vector loads 16)
PARTS = ("gate", "up", "down")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExpertLayout:
    """The packed row of one expert in ``codec``'s format.

    Args:
        codec: the weight format. hidden: H. intermediate: I (gate/up ``[I, H]``, down ``[H, I]``).

    Attributes:
        nbytes: bytes of one packed expert (a multiple of 16): the store row, the slot, the copy.
        offsets: ``{(part, component name): (byte offset, Component)}``.
    """

    def __init__(self, codec: Codec, hidden: int, intermediate: int) -> None:
        self.codec, self.hidden, self.intermediate = codec, hidden, intermediate
        self.offsets: dict[tuple[str, str], tuple[int, Component]] = {}
        at = 0
        for part in PARTS:
            for comp in codec.components(*self.shape(part)):
                self.offsets[(part, comp.name)] = (at, comp)
                at = _align(at + comp.nbytes)
        self.nbytes = at

    def shape(self, part: str) -> tuple[int, int]:
        """``(out, in)`` of a matrix: ``(I, H)`` for gate and up, ``(H, I)`` for down."""
        h, i = self.hidden, self.intermediate
        return (h, i) if part == "down" else (i, h)

    @property
    def component_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.codec.components(*self.shape("gate")))

    def view(self, rows: torch.Tensor, part: str, name: str) -> torch.Tensor:
        """The component ``name`` of ``part`` in uint8 ``rows [..., nbytes]``, viewed as its dtype
        and shape ``[..., *shape]`` (no copy)."""
        at, comp = self.offsets[(part, name)]
        return rows[..., at : at + comp.nbytes].view(comp.dtype).unflatten(-1, comp.shape)

    def write(self, row: torch.Tensor, part: str, name: str, tensor: torch.Tensor) -> None:
        """Copy one component (already in its stored dtype and shape) into ``row [nbytes]``."""
        self.view(row, part, name).copy_(tensor)

    def dequant(self, rows: torch.Tensor, part: str, dtype: torch.dtype) -> torch.Tensor:
        """``part`` of ``rows [..., nbytes]`` as floats ``[..., out, in]`` in ``dtype``."""
        comps = {name: self.view(rows, part, name) for name in self.component_names}
        return self.codec.dequantize(comps, *self.shape(part), dtype)

    def gate_up(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[..., 2I, H]``: gate rows then up rows, as the plain slot views."""
        return torch.cat([self.dequant(rows, "gate", dtype), self.dequant(rows, "up", dtype)], dim=-2)

    def describe(self) -> str:
        return self.codec.describe()


class DequantSlots:
    """Read-only, index-only stand-in for a partition's slot views over quantized slots.

    Args:
        layout: the packed row. slots: ``[S, nbytes]`` uint8. which: ``gate_up`` or ``down``.
        dtype: the compute dtype. transposed: give ``[n, in, out]`` (the grouped GEMMs' right
            operand) instead of ``[n, out, in]``.

    ``obj[s]`` dequantizes slot ``s``; ``obj[a:b]`` slots ``a..b-1`` (``[n, ...]``). Each access
    dequantizes anew: nothing is cached, so device memory holds only the quantized slots.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        slots: torch.Tensor,
        which: str,
        dtype: torch.dtype,
        transposed: bool = False,
    ) -> None:
        self.layout, self.slots, self.which, self.dtype, self.transposed = (
            layout,
            slots,
            which,
            dtype,
            transposed,
        )

    def __len__(self) -> int:
        return self.slots.shape[0]

    def __getitem__(self, index: int | slice) -> torch.Tensor:
        rows = self.slots[index]
        lay = self.layout
        w = (
            lay.gate_up(rows, self.dtype)
            if self.which == "gate_up"
            else lay.dequant(rows, "down", self.dtype)
        )
        return w.transpose(-1, -2) if self.transposed else w
