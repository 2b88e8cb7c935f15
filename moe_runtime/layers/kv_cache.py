"""Paged KV cache: a pool of fixed-size blocks per layer, indexed through block tables.

Layout (:class:`KVLayout`): the decoder layers split into block groups, full-attention layers in
one, sliding-window layers (gpt-oss) in another, as vLLM's hybrid allocator does; the groups share
one pool of ``num_blocks`` blocks (``moe_runtime.engine.kv_manager``), and a block holds
``block_size`` token positions of ``slots`` layers, the largest group's layer count (a smaller
group leaves slots unused). Layer ``i`` of group ``g`` is slot ``slot_of[i]``: its K and V are
``k[i]``, ``v[i]``, ``[num_blocks, block_size, kv_heads, head_dim]`` each (the NHD page layout of
flash-attn and FlashInfer; strided views of one tensor whose rows hold a token's keys then its
values), position ``p`` of a sequence at ``[table[p // block_size], p % block_size]`` with
``table`` its block table in group ``g``. One block of a group is
``slots * block_size * kv_elements_per_token * itemsize`` bytes (:meth:`KVLayout.bytes_per_block`).

The pool's size is a constructor argument; :meth:`KVLayout.default_num_blocks` gives the size the
runtime uses without ``--num-kv-blocks``: the memory of the static layout it replaced
(``max_batch_size`` sequences of ``max_model_len`` positions, sliding layers their window), at
least what one sequence needs alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """How the layers' KV positions map onto blocks.

    Attributes:
        block_size: token positions per block.
        windows: per block group, its sliding window in positions, or None (full attention).
        group_of: per decoder layer, its block group.
        slot_of: per decoder layer, its index among its group's layers (its slot in a block).
        slots: layers per block (the largest group's layer count).
        elements_per_token: KV elements of one token in one layer (``ModelConfig.kv_elements_per_token``).
    """

    block_size: int
    windows: tuple[int | None, ...]
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]
    slots: int
    elements_per_token: int

    @classmethod
    def build(
        cls,
        num_layers: int,
        block_size: int,
        elements_per_token: int,
        max_len: int,
        windows: dict[int, int] | None = None,
    ) -> KVLayout:
        """Full-attention layers form group 0; sliding layers of a window shorter than ``max_len``
        one group per window, in increasing window order (a window of ``max_len`` or more is full
        attention).

        Raises:
            ValueError: ``block_size`` < 1 or a window < 1.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        windows = {i: w for i, w in (windows or {}).items() if w < max_len}
        if any(w < 1 for w in windows.values()):
            raise ValueError(f"sliding windows must be >= 1, got {sorted(set(windows.values()))}")
        kinds: list[int | None] = []
        if len(windows) < num_layers:
            kinds.append(None)
        kinds += sorted(set(windows.values()))
        group_of = tuple(kinds.index(windows.get(i)) for i in range(num_layers))
        counts = [0] * len(kinds)
        slot_of = []
        for g in group_of:
            slot_of.append(counts[g])
            counts[g] += 1
        return cls(block_size, tuple(kinds), group_of, tuple(slot_of), max(counts), elements_per_token)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def bytes_per_block(self, itemsize: int) -> int:
        """Bytes of one block (its ``slots`` layers' K and V, or latents, of ``block_size`` tokens)."""
        return self.slots * self.block_size * self.elements_per_token * itemsize

    def blocks_per_sequence(self, num_tokens: int, step_tokens: int = 1) -> int:
        """Blocks a sequence of ``num_tokens`` positions holds over all groups while its last
        ``step_tokens`` are computed in one step (a sliding group: its window before them plus
        them)."""
        full = cdiv(num_tokens, self.block_size)
        total = 0
        for w in self.windows:
            if w is None:
                total += full
            else:
                total += min(full, cdiv(w - 1 + step_tokens, self.block_size) + 1)
        return total

    def min_num_blocks(self, max_len: int, max_step_tokens: int) -> int:
        """The smallest pool that lets one ``max_len`` sequence run alone (chunks of up to
        ``max_step_tokens``): a smaller pool could never finish it."""
        return self.blocks_per_sequence(max_len, max_step_tokens)

    def default_num_blocks(self, max_batch_size: int, max_len: int, max_step_tokens: int) -> int:
        """The static layout's memory: ``max_batch_size`` sequences of ``max_len`` positions (a
        sliding group: their windows, plus one block for their alignment), at least
        :meth:`min_num_blocks`."""
        steady = max_batch_size * self.blocks_per_sequence(max_len)
        return max(steady, self.min_num_blocks(max_len, max_step_tokens))


class PagedCache:
    """What every paged cache shows of its :class:`KVLayout` (``self.layout``): block size, each
    layer's block group and each group's sliding window."""

    layout: KVLayout

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def group_of(self) -> tuple[int, ...]:
        return self.layout.group_of

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.layout.windows


class PagedKVCache(PagedCache):
    """K and V blocks of every layer in one allocation, ``[slots, num_blocks, block_size, 2 * kv_heads,
    head_dim]``: a token's keys (heads ``0 .. kv_heads - 1``) sit right before its values, so a
    step's new keys and values, adjacent in the fused q/k/v projection's output, are written with
    one ``index_copy_`` and a decode gathers both with one ``index_select``
    (``moe_runtime.layers.attention``).

    Views per decoder layer: ``kv_flat[layer]`` ``[num_blocks * block_size, 2 * kv_heads, 1,
    head_dim]`` (both; the 1 is a decode query's length, the shape of the model's per-head view of
    its projection, so the step's keys and values are written as they are); ``k[layer]``,
    ``v[layer]`` ``[num_blocks, block_size, kv_heads, head_dim]`` and ``k_flat``/``v_flat``
    ``[num_blocks * block_size, kv_heads, head_dim]`` (strided: the other half of each row is the
    other tensor).

    Args:
        layout: the :class:`KVLayout` (its ``elements_per_token`` is ``2 * kv_heads * head_dim``).
        num_blocks: blocks in the pool.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layout.slots, num_blocks, layout.block_size, 2 * kv_heads, head_dim)
        self._kv = torch.zeros(shape, dtype=dtype, device=device)
        per_layer = [self._kv[s] for s in layout.slot_of]
        self.k = [x[:, :, :kv_heads] for x in per_layer]
        self.v = [x[:, :, kv_heads:] for x in per_layer]
        # [num_blocks * block_size, 2 * kv_heads, (1,) head_dim]: slot-indexed writes and gathers
        flat = [x.view(-1, 2 * kv_heads, head_dim) for x in per_layer]
        self.kv_flat = [x.unsqueeze(2) for x in flat]
        self.k_flat = [x[:, :kv_heads] for x in flat]
        self.v_flat = [x[:, kv_heads:] for x in flat]
        self.flex = None  # CUDA decodes in place (moe_runtime.layers.paged_decode), set by the engine
        self.layout = layout
        self.num_blocks = num_blocks

    @property
    def sliding(self) -> dict[int, int]:
        """Sliding-window layer -> window (layers whose group has one)."""
        return {i: self.windows[g] for i, g in enumerate(self.group_of) if self.windows[g] is not None}

    @property
    def nbytes(self) -> int:
        return self._kv.numel() * self._kv.element_size()
