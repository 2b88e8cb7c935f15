"""Building paged KV caches and steps by hand for attention tests."""

from __future__ import annotations

import torch

from moe_runtime.engine.context import StepContext
from moe_runtime.layers.kv_cache import KVLayout, PagedKVCache

CPU = torch.device("cpu")


def paged_cache(
    layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int, windows=None, max_len=1 << 20
) -> PagedKVCache:
    """A float32 CPU cache of ``num_blocks`` blocks (``windows``: sliding layer -> window)."""
    layout = KVLayout.build(layers, block_size, 2 * kv_heads * head_dim, max_len, windows)
    return PagedKVCache(layout, num_blocks, kv_heads, head_dim, torch.float32, CPU)


def scattered_tables(lengths: list[int], cache: PagedKVCache, seed: int = 0) -> list[list[list[int]]]:
    """Per sequence, per block group, distinct blocks in a shuffled order covering ``lengths``."""
    bs, groups = cache.block_size, cache.layout.num_groups
    need = [-(-n // bs) for n in lengths]
    order = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    assert sum(need) * groups <= len(order), "pool too small for these sequences"
    out, at = [], 0
    for n in need:
        per_group = []
        for _ in range(groups):
            per_group.append(order[at : at + n])
            at += n
        out.append(per_group)
    return out


def write(cache: PagedKVCache, layer: int, table: list[int], start: int, k: torch.Tensor, v: torch.Tensor):
    """Put ``k``/``v [n, Hkv, D]`` at positions ``start ..`` of a sequence with block ``table``."""
    bs = cache.block_size
    for i in range(k.shape[0]):
        p = start + i
        cache.k[layer][table[p // bs], p % bs] = k[i]
        cache.v[layer][table[p // bs], p % bs] = v[i]


def step(tables, past, new, cache: PagedKVCache, sample=None) -> StepContext:
    """A step over sequences with block ``tables`` (per sequence, per group)."""
    ids = [str(i) for i in range(len(past))]
    return StepContext.build(ids, tables, past, new, sample or [True] * len(past), CPU, cache.block_size)
