"""Static latent KV cache for multi-head latent attention (DeepSeek-V2/V3).

One tensor ``latent [layers, rows, 1, max_len, kv_lora_rank + qk_rope_head_dim]``: per token the
RMSNorm'd KV latent and the rotated shared key, never the expanded per-head K/V (for DeepSeek-V3,
576 elements per token and layer instead of 2 x 128 heads x 192). It exposes ``k`` and ``v`` as
that same tensor (one KV head), so ``moe_runtime.layers.attention`` attends over it as keys and as
values (``moe_runtime.layers.mla``). Rows belong to sequences as in
:class:`~moe_runtime.layers.kv_cache.KVCache`. Memory: ``layers * rows * max_len * width * bytes``.
"""

from __future__ import annotations

import torch


class MLACache:
    """Args: num_layers, rows (``max_batch_size``), max_len (``max_model_len``), width
    (``kv_lora_rank + qk_rope_head_dim``), dtype, device."""

    def __init__(
        self, num_layers: int, rows: int, max_len: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.latent = torch.zeros((num_layers, rows, 1, max_len, width), dtype=dtype, device=device)
        self.k = self.v = self.latent  # one KV head: the cached row is both key and value
        self.ring: dict[int, int] = {}  # no sliding-window layers (``KVCache.ring``)
        self.max_len = max_len
        self.rows = rows

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()
