"""The KV-cache block pool: reference counts, the LRU free queue and the prefix-cache map.

vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``), in plain Python: every block is either
held (reference count > 0, by one or more sequences that share it through prefix caching) or free.
Free blocks wait in one queue, least recently freed first; a free block that still holds a cached
prefix keeps its hash until it is taken for new tokens (evicted), so a later request can find it
and take it back out of the queue (a hit). A sequence frees its blocks tail first, so the tail of a
sequence is evicted before its head, the part other requests are likelier to share.

Blocks are registered under ``(group, hash)``: the block groups of a hybrid model (full-attention
layers, sliding-window layers; :class:`moe_runtime.engine.kv_manager.KVCacheManager`) share one
pool but cache their blocks apart. The hash of a full block is :func:`hash_block` of its tokens and
its prefix's hash (vLLM's chained block hash), so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

#: a block table entry for a block a sliding-window layer group no longer needs (freed)
NULL_BLOCK = -1
#: hash of the empty prefix, the parent of a sequence's first block
ROOT_HASH = hashlib.sha256(b"moeserve-kv-block-v1").digest()


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """SHA-256 of a full block's ``tokens`` (int32, little-endian) chained to its ``parent`` hash
    (:data:`ROOT_HASH` for a sequence's first block): 32 bytes.

    A cryptographic hash, as vLLM's default since 0.8: with Python's ``hash`` a crafted prompt
    could collide with another request's prefix and be served its KV cache."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.digest()


class BlockPool:
    """``num_blocks`` KV blocks: who holds them, which are free (LRU), which hold a cached prefix.

    Args:
        num_blocks: blocks in the pool (>= 1); block ids are ``0 .. num_blocks - 1``.
        enable_caching: keep the hashes of freed blocks so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        # free blocks, least recently freed first (dict order); O(1) removal of a hit from the middle
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[tuple[int, bytes], int] = {}  # (group, hash) -> block
        self._key_of: dict[int, tuple[int, bytes]] = {}  # block -> its (group, hash)
        self.evictions = 0  # cached blocks taken for new tokens

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence (cached or not): what an allocation may take."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._cached)

    def is_free(self, block: int) -> bool:
        return self.ref[block] == 0

    def take(self, n: int) -> list[int]:
        """``n`` blocks off the front of the free queue, each held once; a block that held a cached
        prefix loses it (eviction).

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check :attr:`num_free` first).
        """
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked for, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._cached[key]
                self.evictions += 1
            self.ref[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks once more (a prefix-cache hit); a free one leaves the free queue."""
        for block in blocks:
            if self.ref[block] == 0:
                del self._free[block]
            self.ref[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one hold of each block, in the given order; a block nobody holds joins the back of
        the free queue (pass a sequence's blocks tail first: the tail is then evicted first)."""
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self._free[block] = None
            elif self.ref[block] < 0:
                raise ValueError(f"block {block} released more often than held")

    def register(self, block: int, group: int, block_hash: bytes) -> None:
        """Record that ``block`` holds the full block ``block_hash`` of layer group ``group``. When
        another block already holds that content (two requests computed the same prefix at once)
        this one stays unregistered and is recycled as an ordinary block."""
        if not self.enable_caching or block in self._key_of:
            return
        key = (group, block_hash)
        if key not in self._cached:
            self._cached[key] = block
            self._key_of[block] = key

    def lookup(self, group: int, block_hash: bytes) -> int | None:
        """The block holding ``block_hash`` in ``group``, or None."""
        return self._cached.get((group, block_hash))
