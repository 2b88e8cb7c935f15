"""Static KV cache: one row per running sequence, allocated once (gpt-fast style).

Shape per layer: ``[rows, kv_heads, length, head_dim]`` for K and for V, ``length`` being
``max_len`` (the runtime's ``max_model_len``), or for a sliding-window layer whose window is
shorter, the window: a ring where position ``p`` lives at index ``p % window`` (gpt-oss;
``moe_runtime.layers.attention``). A sequence owns one row from admission until it finishes; rows
are recycled by the scheduler. Memory is ``2 * rows * kv_heads * head_dim * bytes * sum(length
over layers)`` (:func:`kv_lengths`); ``rows`` is the scheduler's ``max_batch_size``.
"""

from __future__ import annotations

import torch


def kv_lengths(num_layers: int, max_len: int, windows: dict[int, int] | None = None) -> list[int]:
    """Tokens one KV row holds per layer: ``max_len``, or ``windows[layer]`` where that is shorter.

    Args:
        windows: sliding-window layer -> window in positions (>= 1).
    """
    windows = windows or {}
    return [min(max_len, windows.get(layer, max_len)) for layer in range(num_layers)]


class KVCache:
    """K and V per layer (``k[layer]``, ``v[layer]``: ``[rows, kv_heads, length, head_dim]``).

    Args:
        windows: sliding-window layer -> window; a layer whose window is shorter than ``max_len``
            keeps a ring of ``window`` positions (``ring[layer]``) instead of ``max_len``.
    """

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: dict[int, int] | None = None,
    ) -> None:
        lengths = kv_lengths(num_layers, max_len, windows)
        self.ring = {layer: n for layer, n in enumerate(lengths) if n < max_len}
        self.k: list[torch.Tensor] = [None] * num_layers  # type: ignore[list-item]
        self.v: list[torch.Tensor] = [None] * num_layers  # type: ignore[list-item]
        self._blocks: list[torch.Tensor] = []
        for n in sorted(set(lengths)):  # one allocation per length, viewed per layer
            layers = [i for i, m in enumerate(lengths) if m == n]
            shape = (len(layers), rows, kv_heads, n, head_dim)
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
            self._blocks += [k, v]
            for j, layer in enumerate(layers):
                self.k[layer], self.v[layer] = k[j], v[j]
        self.max_len = max_len
        self.rows = rows

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks)
