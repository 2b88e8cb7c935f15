"""The engine's paged KV cache: block layout, tensors, block manager and the decode attention path.

Built once per engine from the model config and the runtime settings (``--block-size``,
``--num-kv-blocks``, ``--enable-prefix-caching``; the engine's settings carry the memory plan's
pool where it sized one, ``moe_runtime.memory_split``); the sizes come from the memory plan's
arithmetic (``moe_runtime.memory_plan.kv_layout``, ``kv_num_blocks``) so the plan and the
allocation agree to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.config import ModelConfig, RuntimeConfig
from moe_runtime.engine.kv_manager import KVCacheManager
from moe_runtime.engine.prefix_eam import BlockActivations
from moe_runtime.layers.kv_cache import KVLayout, PagedKVCache, cdiv
from moe_runtime.layers.mla_cache import PagedMLACache
from moe_runtime.layers.paged_decode import FlexPagedDecode, decode_path
from moe_runtime.memory_plan import human_bytes, kv_cache_len, kv_layout, kv_num_blocks


@dataclass
class KVSetup:
    """What :func:`build_kv` makes.

    Attributes:
        cache: the tensors (``PagedKVCache``, or ``PagedMLACache`` for latent attention).
        manager: the block manager the scheduler allocates through.
        activations: per block, its tokens' expert counts (prefix caching with a tracer), or None.
        activation_group: the full-attention block group whose blocks keep those counts.
        attention: ``flex`` (CUDA decodes read blocks in place) or ``gather``; ``why`` says why.
    """

    layout: KVLayout
    cache: PagedKVCache | PagedMLACache
    manager: KVCacheManager
    activations: BlockActivations | None
    activation_group: int | None
    attention: str
    why: str

    def describe(self, itemsize: int) -> str:
        """``KV cache 64.0 MiB (1024 blocks x 16 tokens, 64.00 KiB each; 2 sliding layers keep
        their 4-token window; prefix caching on), attention gather (cpu: ...)``."""
        lay = self.layout
        sliding = self.cache.sliding
        notes = [
            f"{self.cache.num_blocks} blocks x {lay.block_size} tokens, "
            f"{human_bytes(lay.bytes_per_block(itemsize))} each"
        ]
        if sliding:
            windows = "/".join(str(w) for w in sorted(set(sliding.values())))
            notes.append(f"{len(sliding)} sliding layers keep their {windows}-token window")
        notes.append(f"prefix caching {'on' if self.manager.enable_caching else 'off'}")
        return (
            f"KV cache {self.cache.nbytes / (1 << 20):.1f} MiB ({'; '.join(notes)}), "
            f"attention {self.attention} ({self.why})"
        )


def build_kv(
    cfg: ModelConfig, runtime: RuntimeConfig, device: torch.device, num_moe_layers: int, tracing: bool
) -> KVSetup:
    """The KV cache of ``cfg`` under ``runtime`` on ``device``; ``tracing``: a tracer recorder
    runs (cached blocks then keep their tokens' expert counts).

    Raises:
        ConfigError: ``--num-kv-blocks`` below one ``max_model_len`` sequence's need.
    """
    layout = kv_layout(cfg, runtime)
    num_blocks = kv_num_blocks(cfg, runtime)
    dtype = runtime.torch_dtype
    if cfg.mla is not None:  # the latent, not expanded K/V
        cache: PagedKVCache | PagedMLACache = PagedMLACache(layout, num_blocks, dtype, device)
    else:
        cache = PagedKVCache(layout, num_blocks, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    path, why = decode_path(
        device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layout.block_size, cfg.mla is not None
    )
    if path == "flex":
        max_blocks = cdiv(kv_cache_len(cfg, runtime), layout.block_size)
        cache.flex = FlexPagedDecode(  # type: ignore[union-attr]
            num_blocks, layout.block_size, runtime.max_batch_size, max_blocks, layout.num_groups, device
        )
    manager = KVCacheManager(num_blocks, layout.block_size, layout.windows, runtime.enable_prefix_caching)
    full = [g for g, w in enumerate(layout.windows) if w is None]
    group = full[0] if full else None
    activations = None
    if tracing and runtime.enable_prefix_caching and group is not None:
        activations = BlockActivations(num_blocks, num_moe_layers, cfg.num_experts)
    return KVSetup(layout, cache, manager, activations, group, path, why)
