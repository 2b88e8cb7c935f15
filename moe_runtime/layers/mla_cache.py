"""Paged latent KV cache for multi-head latent attention (DeepSeek-V2/V3).

One tensor ``latent [layers, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``: per
token the RMSNorm'd KV latent and the rotated shared key, never the expanded per-head K/V (for
DeepSeek-V3, 576 elements per token and layer instead of 2 x 128 heads x 192). It exposes ``k`` and
``v`` as that same tensor (one KV head), so ``moe_runtime.layers.attention`` attends over it as
keys and as values (``moe_runtime.layers.mla``), through the same block tables as
:class:`~moe_runtime.layers.kv_cache.PagedKVCache` (one block group: every layer attends fully).
Memory: ``layers * num_blocks * block_size * width * bytes`` (``KVLayout.bytes_per_block``).
"""

from __future__ import annotations

import torch

from moe_runtime.layers.kv_cache import KVLayout, PagedCache


class PagedMLACache(PagedCache):
    """Args: layout (one group, ``elements_per_token`` the latent width), num_blocks, dtype, device."""

    def __init__(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        if layout.num_groups != 1:
            raise ValueError("latent attention has no sliding-window layers: one block group")
        shape = (layout.slots, num_blocks, layout.block_size, 1, layout.elements_per_token)
        self.latent = torch.zeros(shape, dtype=dtype, device=device)
        self.k = self.v = [self.latent[s] for s in layout.slot_of]  # the cached row is key and value
        self.k_flat = self.v_flat = [x.view(-1, 1, layout.elements_per_token) for x in self.k]
        self.flex = None  # latent attention gathers (moe_runtime.layers.paged_decode)
        self.layout = layout
        self.num_blocks = num_blocks

    @property
    def sliding(self) -> dict[int, int]:
        return {}

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()
