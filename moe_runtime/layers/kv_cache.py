"""Static KV cache: one row per running sequence, allocated once (gpt-fast style).

Shape per layer: ``[rows, kv_heads, max_len, head_dim]`` for K and for V. A sequence owns one row
from admission until it finishes; rows are recycled by the scheduler. Memory is
``2 * layers * rows * kv_heads * max_len * head_dim * bytes``; ``rows`` is the scheduler's
``max_batch_size`` and ``max_len`` the runtime's ``max_model_len``.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.rows = rows

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
