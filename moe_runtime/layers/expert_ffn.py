"""What one MoE layer's experts compute per row beyond the plain SwiGLU (gpt-oss's biases and
activation): :class:`ExpertFFN` and the activation every expert path applies (``_hidden``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

RowBias = tuple[torch.Tensor | None, torch.Tensor | None]  # per-row gate_up [n, 2I] / down [n, H] biases


@dataclass(frozen=True, slots=True)
class ExpertFFN:
    """What one MoE layer's experts compute beyond ``down(silu(gate) * up)`` (gpt-oss).

    Attributes:
        gate_up_bias: ``[E, 2I]`` bias of the fused gate/up projection, ``[gate | up]`` order as the
            slots' rows, or None. down_bias: ``[E, H]`` bias of the down projection, or None.
        act: ``gate_up [n, 2I]`` (``[gate | up]``, a fresh tensor it may overwrite) -> ``[n, I]``;
            None = ``silu(gate) * up``. It must give each row the same bits whatever rows are
            beside it (the paths batch rows differently): see ``ClampedSwiGLU``.
    """

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    act: Callable[[torch.Tensor], torch.Tensor] | None = None

    def rows(self, experts: torch.Tensor, device: torch.device) -> RowBias:
        """Both biases of the rows whose experts are ``experts [n]`` (int64), on ``device``."""
        return tuple(  # type: ignore[return-value]
            None if b is None else b.index_select(0, experts).to(device)
            for b in (self.gate_up_bias, self.down_bias)
        )


def _hidden(gate_up: torch.Tensor, ffn: ExpertFFN | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The activation of ``gate_up [n, 2I]`` (plus its bias rows) -> ``[n, I]``."""
    if bias is not None:
        gate_up = gate_up + bias
    if ffn is not None and ffn.act is not None:
        return ffn.act(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y`` plus the down projection's bias rows, if any."""
    return y if bias is None else y + bias
