"""CUDA decode attention that reads the paged KV cache in place: PyTorch's FlexAttention.

Why FlexAttention (``torch.nn.attention.flex_attention``), of the well-kept libraries:

* it ships with torch (no second CUDA build to match), and takes the block pool as keys and values
  (``[1, Hkv, num_blocks * block_size, D]``, a view: nothing copied) with a ``BlockMask`` whose
  KV block size is the page size, built from the block tables (``kv_num_blocks``,
  ``kv_indices``) and a ``mask_mod`` that maps a physical position back to the sequence's logical
  one (a ``[seqs, num_blocks + 1]`` table, as ``torch.nn.attention.experimental._paged_attention``
  does), so the length, the sliding window and GQA (power-of-two groups) are handled in the kernel;
  it returns the log-sum-exp, so gpt-oss's attention sinks stay a rescale;
* it never plans per step: every tensor the mask reads is a persistent device buffer of fixed
  shape (``max_seqs`` rows, queries padded to them), refreshed with one host-to-device copy and
  two scatters per step, so the compiled kernel (``torch.compile``, ``dynamic=False``) is reused
  at every step and could be captured in a CUDA graph;
* the others: FlashInfer's paged decode wrapper calls ``plan()`` on the host whenever the
  lengths change, i.e. every step; flash-attn 2's ``flash_attn_with_kvcache(block_table=...)``
  and torch's own ``varlen_attn(block_table=...)`` (the same FA2 kernels) check ``page_block_size
  % 256 == 0`` (``flash_api.cpp``), so 16-token blocks cannot use them, and FA2 has no head dims
  above 256 (latent attention's 576).

Not covered, so they gather blocks instead (``moe_runtime.layers.attention``): the CPU, latent
attention (one 576-wide head), query-to-KV head ratios that are not a power of two
(FlexAttention's decoding kernel), block sizes that are not a multiple of 16, prefill chunks. The
choice is made once at load by :func:`decode_path` and named in the load summary.

Assumptions, not yet checked on a GPU (none was available): the compiled decode kernel accepts the
pool's strided view and a 16-wide KV block; rows past the real batch (no blocks) come out as zeros.
The same module runs eagerly on the CPU, where ``tests/test_paged_attention.py`` checks it against
the gathered path (FlexAttention's unfused reference evaluates the ``mask_mod`` on every key).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch

_compiled: Any = None


def decode_path(
    device: torch.device,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    latent: bool,
) -> tuple[str, str]:
    """``("flex", why)`` where CUDA decodes can read the blocks in place, else ``("gather", why)``.

    Args:
        heads / kv_heads / head_dim: the attention shape; latent: multi-head latent attention.
    """
    if device.type != "cuda":
        return "gather", f"{device.type}: blocks gathered per step"
    if latent:
        return "gather", "latent attention (one 576-wide head): blocks gathered"
    if block_size % 16:
        return "gather", f"block size {block_size} is not a multiple of 16: blocks gathered"
    group = heads // kv_heads
    if group & (group - 1):
        return "gather", f"{group} query heads per KV head is not a power of two: blocks gathered"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return "gather", f"head dim {head_dim} is not a power of two >= 16: blocks gathered"
    if importlib.util.find_spec("triton") is None:
        return "gather", "no triton for FlexAttention: blocks gathered"
    return "flex", "decode reads blocks in place (FlexAttention)"


def _flex(compiled: bool):
    """``flex_attention``, compiled once per process on CUDA; eager on the CPU (tests)."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled


class _GroupBuffers:
    """One block group's persistent decode metadata and its ``BlockMask``."""

    def __init__(self, max_seqs: int, max_blocks: int, num_blocks: int, block_size: int, device) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        i32 = dict(dtype=torch.int32, device=device)
        self.kv_num = torch.zeros(max_seqs, 1, 1, **i32)
        self.kv_idx = torch.zeros(max_seqs, 1, 1, max_blocks, **i32)
        self.logical = torch.full((max_seqs, num_blocks + 1), -1, **i32)  # last column: padding
        self.seq_len = torch.zeros(max_seqs, **i32)
        self.lo = torch.zeros(max_seqs, **i32)
        logical, seq_len, lo, bs = self.logical, self.seq_len, self.lo, block_size

        def mask_mod(b, h, q_idx, kv_idx):
            lg = logical[b, kv_idx // bs]
            pos = lg * bs + kv_idx % bs
            return (lg >= 0) & (pos < seq_len[b]) & (pos >= lo[b])

        self.mask = BlockMask.from_kv_blocks(
            self.kv_num,
            self.kv_idx,
            BLOCK_SIZE=(128, block_size),
            mask_mod=mask_mod,
            seq_lengths=(1, num_blocks * block_size),
            compute_q_blocks=False,
        )


class FlexPagedDecode:
    """Decode attention of up to ``max_seqs`` sequences over the block pool, in place.

    Args:
        num_blocks / block_size: the pool. max_seqs: the scheduler's batch size (queries are
            padded to it: fixed shapes, one compiled kernel). max_blocks: blocks of the longest
            sequence (``max_model_len`` positions). num_groups: block groups of the cache.
        compiled: ``torch.compile`` the kernel (CUDA); False runs FlexAttention eagerly (CPU tests).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_seqs: int,
        max_blocks: int,
        num_groups: int,
        device: torch.device,
        compiled: bool = True,
    ) -> None:
        self.num_blocks, self.block_size, self.max_seqs = num_blocks, block_size, max_seqs
        self.device = device
        self.compiled = compiled
        self.groups = [
            _GroupBuffers(max_seqs, max_blocks, num_blocks, block_size, device) for _ in range(num_groups)
        ]
        self._queries: dict[tuple, torch.Tensor] = {}

    def load(self, step, group: int, window: int | None) -> int:
        """Refresh ``group``'s buffers for the step's decoding sequences (one copy); returns how
        many there are. Called once per step and group (``step.cached``)."""
        bs, n = self.block_size, self.num_blocks
        seqs = step.decode_seqs
        b = len(seqs)
        ctx = np.asarray([step.ctx_lens[i] for i in seqs], dtype=np.int64)
        lo = np.maximum(ctx - window, 0) if window is not None else np.zeros(b, dtype=np.int64)
        first = lo // bs
        count = -(-ctx // bs) - first
        width = int(count.max())
        idx = np.full((b, width), n, dtype=np.int64)  # padding scatters into the spare column
        tab = step.tables_host[group]
        for r, i in enumerate(seqs):
            idx[r, : count[r]] = tab[i, first[r] : first[r] + count[r]]
        host = np.concatenate([count, ctx, lo, first, idx.reshape(-1)])
        dev = torch.from_numpy(host).to(self.device).to(torch.int32).split([b, b, b, b, b * width])
        buf = self.groups[group]
        buf.kv_num.zero_()
        buf.kv_num[:b, 0, 0] = dev[0]
        buf.kv_idx[:b, 0, 0, :width] = dev[4].view(b, width).clamp(max=n - 1)
        buf.seq_len[:b] = dev[1]
        buf.lo[:b] = dev[2]
        buf.logical.fill_(-1)
        logical = dev[3][:, None] + torch.arange(width, dtype=torch.int32, device=self.device)[None, :]
        buf.logical[:b].scatter_(1, dev[4].view(b, width).long(), logical)
        buf.logical[:, n] = -1
        return b

    def decode(
        self, q: torch.Tensor, kc, vc, step, group: int, window: int | None, sinks=None
    ) -> torch.Tensor:
        """``q [B_d, Hq, D]`` (the step's decodes, in order) over ``kc``/``vc [num_blocks *
        block_size, Hkv, D]`` (the pool's flat views) -> ``[B_d, Hq, 1, D]``."""
        from torch.nn.attention.flex_attention import AuxRequest

        b = step.cached(("flex", group), self.load, step, group, window)
        key = (q.dtype, q.shape[1], q.shape[2])
        qbuf = self._queries.get(key)
        if qbuf is None:
            qbuf = self._queries[key] = q.new_zeros(self.max_seqs, q.shape[1], 1, q.shape[2])
        qbuf[:b, :, 0] = q
        hkv, d = kc.shape[-2], kc.shape[-1]
        keys = kc.view(1, -1, hkv, d).transpose(1, 2)  # [1, Hkv, num_blocks * block_size, D]
        vals = vc.view(1, -1, hkv, d).transpose(1, 2)
        aux = AuxRequest(lse=True) if sinks is not None else None
        res = _flex(self.compiled)(
            qbuf, keys, vals, block_mask=self.groups[group].mask, enable_gqa=True, return_aux=aux
        )
        if sinks is None:
            return res[:b]
        out, lse = res[0][:b], res[1].lse[:b]  # lse [B, Hq, 1], natural log
        return out * torch.sigmoid(lse - sinks.float().view(-1, 1)).unsqueeze(-1).to(out.dtype)
