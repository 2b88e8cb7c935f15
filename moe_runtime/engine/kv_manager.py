"""The paged KV cache's block manager: block tables, admission by free blocks, prefix caching.

The shape of vLLM v1's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``), pure Python: the
scheduler asks it for blocks, it never touches a tensor. The KV cache is a pool of fixed-size
blocks of ``block_size`` token positions (:class:`~moe_runtime.engine.block_pool.BlockPool`); each
running sequence has, per layer group, a block table: its ``i``-th entry holds positions
``i * block_size .. (i + 1) * block_size - 1`` of that group's layers.

Layer groups (vLLM's hybrid allocator): the full-attention layers form one group; the
sliding-window layers of a window ``w`` another (gpt-oss). The groups share the pool; a block of
either holds the same number of layers (``moe_runtime.layers.kv_cache.KVLayout``). A sliding group
frees a sequence's blocks that fell out of every window it will still attend (all positions below
``num_computed - w + 1``): their table entries become :data:`NULL_BLOCK`.

Prefix caching (vLLM's scheme): once a block is full and computed it is hashed by its tokens and
its prefix's hash (:func:`~moe_runtime.engine.block_pool.hash_block`) and registered; a new request
whose first full blocks hash alike takes those blocks (shared, reference-counted) instead of
computing them: :meth:`KVCacheManager.find_cached` finds the longest prefix that every group holds
(a sliding group only needs the blocks inside the window of the first token still to compute),
leaving at least the last prompt token to compute (its logits sample the first output). Freed
blocks stay cached until an allocation evicts them, least recently freed first.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from moe_runtime.engine.block_pool import NULL_BLOCK, ROOT_HASH, BlockPool, hash_block
from moe_runtime.layers.kv_cache import cdiv


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A prefix found in the cache: ``tokens`` positions (a multiple of the block size) and, per
    layer group, the blocks holding them (:data:`NULL_BLOCK` where a sliding group needs none)."""

    tokens: int
    blocks: tuple[tuple[int, ...], ...]


class KVCacheManager:
    """Blocks and block tables of the running sequences.

    Args:
        num_blocks: blocks in the pool (the KV cache's size; a memory plan chooses it).
        block_size: token positions per block (>= 1).
        windows: per layer group, its sliding window in positions, or None for full attention;
            default one full-attention group.
        enable_caching: prefix caching (hash, register and reuse full blocks).

    A sequence is keyed by ``request_id``; the manager reads its ``prompt_token_ids``,
    ``output_token_ids``, ``num_computed`` and keeps the hashes of its full blocks in
    ``seq.kv_hashes`` (they survive preemption).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: Seq[int | None] = (None,),
        enable_caching: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows:
            raise ValueError("at least one layer group")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[list[int]]] = {}
        self._registered: dict[str, int] = {}  # full blocks registered per sequence
        self._scratch = 0
        # prefix-cache lookups of admitted sequences: tokens asked for and tokens found
        self.queries = 0
        self.hits = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Share of the pool held by sequences (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, seq: Any) -> list[bytes]:
        """Hashes of ``seq``'s full blocks (``seq.kv_hashes``, extended to its current tokens)."""
        hashes: list[bytes] = seq.kv_hashes
        bs = self.block_size
        n_full = seq.num_tokens // bs
        if len(hashes) < n_full:
            parent = hashes[-1] if hashes else ROOT_HASH
            for j in range(len(hashes), n_full):
                parent = hash_block(parent, seq.tokens(j * bs, bs))
                hashes.append(parent)
        return hashes

    def find_cached(self, seq: Any) -> CacheHit | None:
        """The longest cached prefix of ``seq``'s tokens every layer group holds, leaving at least
        one token to compute; None when there is none (or caching is off). Changes nothing."""
        if not self.enable_caching:
            return None
        bs = self.block_size
        hashes = self.block_hashes(seq)[: (seq.num_tokens - 1) // bs]
        pool = self.pool
        h = len(hashes)
        for g, w in enumerate(self.windows):  # full groups: every block of the prefix
            if w is not None:
                continue
            for j in range(h):
                if pool.lookup(g, hashes[j]) is None:
                    h = j
                    break
        while h > 0 and not all(self._window_cached(g, w, hashes, h) for g, w in self._sliding()):
            h -= 1
        if h == 0:
            return None
        blocks = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else max(0, h * bs - w + 1) // bs
            row = [NULL_BLOCK] * first + [pool.lookup(g, hashes[j]) for j in range(first, h)]
            blocks.append(tuple(row))  # type: ignore[arg-type]
        return CacheHit(h * bs, tuple(blocks))

    def _sliding(self) -> list[tuple[int, int]]:
        return [(g, w) for g, w in enumerate(self.windows) if w is not None]

    def _window_cached(self, group: int, window: int, hashes: list[bytes], h: int) -> bool:
        """Group ``group`` holds the blocks a query at position ``h * block_size`` sees."""
        first = max(0, h * self.block_size - window + 1) // self.block_size
        return all(self.pool.lookup(group, hashes[j]) is not None for j in range(first, h))

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq: Any, num_new: int, hit: CacheHit | None = None) -> bool:
        """Make room for ``seq``'s next ``num_new`` positions (from ``hit.tokens`` for a sequence
        being admitted with a cache hit, else from ``seq.num_computed``).

        A sliding group first frees the sequence's blocks that fell out of every window. Returns
        False, taking nothing, when the free blocks do not suffice (the caller preempts or waits).
        """
        rid = seq.request_id
        tables = self._tables.get(rid)
        bs = self.block_size
        pool = self.pool
        if tables is None:
            start = hit.tokens if hit is not None else seq.num_computed
            tables = [list(b) for b in hit.blocks] if hit is not None else [[] for _ in self.windows]
            reused = {b for row in tables for b in row if b != NULL_BLOCK}
            revived = sum(1 for b in reused if pool.is_free(b))
        else:
            start, reused, revived = seq.num_computed, set(), 0
            self._drop_out_of_window(tables, start)
        end = cdiv(start + num_new, bs)
        need = sum(max(0, end - len(row)) for row in tables)
        if need + revived > pool.num_free:
            return False
        if rid not in self._tables:
            pool.touch(reused)
            self._tables[rid] = tables
            self._registered[rid] = hit.tokens // bs if hit is not None else 0
        for row in tables:
            if end > len(row):
                row.extend(pool.take(end - len(row)))
        return True

    def _drop_out_of_window(self, tables: list[list[int]], start: int) -> None:
        """Free the blocks of sliding groups below the window of position ``start``."""
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            row = tables[g]
            first = min(len(row), max(0, start - w + 1) // self.block_size)
            for j in range(first - 1, -1, -1):  # tail first, as free() does
                if row[j] == NULL_BLOCK:
                    break
                self.pool.release((row[j],))
                row[j] = NULL_BLOCK

    def cache_computed(self, seq: Any) -> None:
        """Register ``seq``'s blocks that are full and computed (``seq.num_computed``) in the prefix
        cache; call after each step that computed its tokens."""
        rid = seq.request_id
        if not self.enable_caching or rid not in self._tables:
            return
        n_full = seq.num_computed // self.block_size
        done = self._registered[rid]
        if n_full <= done:
            return
        hashes = self.block_hashes(seq)
        for g, row in enumerate(self._tables[rid]):
            for j in range(done, min(n_full, len(row))):
                if row[j] != NULL_BLOCK:
                    self.pool.register(row[j], g, hashes[j])
        self._registered[rid] = n_full

    def free(self, seq: Any) -> None:
        """Release every block ``seq`` holds (tail first; cached ones stay findable until evicted)."""
        tables = self._tables.pop(seq.request_id, None)
        self._registered.pop(seq.request_id, None)
        if tables is None:
            return
        longest = max(len(row) for row in tables)
        for j in range(longest - 1, -1, -1):
            for row in tables:
                if j < len(row) and row[j] != NULL_BLOCK:
                    self.pool.release((row[j],))

    def tables(self, seq: Any) -> list[list[int]]:
        """``seq``'s block table per layer group (the manager's lists: do not change them)."""
        return self._tables[seq.request_id]

    def holds(self, seq: Any) -> bool:
        return seq.request_id in self._tables

    def record_lookup(self, seq: Any, hit: CacheHit | None) -> None:
        """Count an admitted sequence's prefix-cache lookup (``queries``/``hits``, in tokens)."""
        self.queries += seq.num_tokens
        self.hits += hit.tokens if hit is not None else 0

    # ------------------------------------------------------------------ scratch
    def allocate_scratch(self, num_tokens: int) -> list[list[int]] | None:
        """Uncached blocks for a one-step computation outside scheduling (teacher-forced scoring):
        ``num_tokens`` positions in every group, or None when not enough blocks are free."""
        n = cdiv(num_tokens, self.block_size)
        if n * len(self.windows) > self.pool.num_free:
            return None
        return [self.pool.take(n) for _ in self.windows]

    def free_scratch(self, tables: list[list[int]]) -> None:
        for row in tables:
            self.pool.release(reversed(row))
