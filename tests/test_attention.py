"""Attention over a packed mixed step on the paged KV cache: decodes batched in one call, prefill
chunks (fresh or with a past) causal, each sequence's blocks scattered over the pool; every token's
output equals a plain softmax attention over its own sequence."""

from __future__ import annotations

import pytest
import torch
from paged_helpers import paged_cache, scattered_tables, step, write

from moe_runtime.layers.attention import CUDA_BACKENDS, attention

HQ, HKV, D = 4, 2, 8


def _reference(q, keys, values, past):
    """Plain attention of ``q [n, Hq, D]`` at positions ``past ..`` over ``keys/values [ctx, Hkv, D]``."""
    k = keys.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1).double()  # [Hq, ctx, D]
    v = values.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1).double()
    scores = q.transpose(0, 1).double() @ k.transpose(1, 2) / D**0.5  # [Hq, n, ctx]
    n, ctx = q.shape[0], keys.shape[0]
    allowed = torch.arange(ctx)[None, :] <= (past + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)  # [n, Hq * D]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_step_matches_per_sequence_attention(block_size):
    """A decode (past 9), a prefill chunk with a past (past 5, 4 new), a fresh prompt (6 new) and
    another decode (past 3), each over several blocks (one position per block at size 1)."""
    torch.manual_seed(0)
    cache = paged_cache(1, HKV, D, num_blocks=64, block_size=block_size)
    past, new = [9, 5, 0, 3], [1, 4, 6, 1]
    tables = scattered_tables([p + n for p, n in zip(past, new)], cache)
    history = [(torch.randn(p, HKV, D), torch.randn(p, HKV, D)) for p in past]
    for (k, v), t in zip(history, tables):
        write(cache, 0, t[0], 0, k, v)
    st = step(tables, past, new, cache)
    assert not st.all_decode and st.prefill_seqs == [1, 2]
    assert st.prefill_mask is not None  # both prefill chunks in one padded call
    t = sum(new)
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    got = attention(q, k, v, 0, cache, st)
    for i in range(4):
        a, n = st.starts[i], new[i]
        keys = torch.cat([history[i][0], k[a : a + n]])
        vals = torch.cat([history[i][1], v[a : a + n]])
        want = _reference(q[a : a + n], keys, vals, past[i])
        torch.testing.assert_close(got[a : a + n].double(), want, atol=1e-5, rtol=0)


def test_step_writes_new_keys_into_their_blocks():
    """The step's keys land at ``table[p // block_size], p % block_size``: a 7-token prompt over
    blocks 5, 2 (block size 4) and a decode at position 3 of block 0."""
    cache = paged_cache(1, HKV, D, num_blocks=8, block_size=4)
    st = step([[[5, 2]], [[0]]], [0, 3], [7, 1], cache)
    k = torch.arange(8.0)[:, None, None].expand(8, HKV, D).contiguous()
    attention(torch.randn(8, HQ, D), k, k.clone(), 0, cache, st)
    got = [cache.k[0][b, o, 0, 0].item() for b, o in [(5, 0), (5, 3), (2, 0), (2, 2), (0, 3)]]
    assert got == [0.0, 3.0, 4.0, 6.0, 7.0]
    assert st.slots[0].tolist() == [20, 21, 22, 23, 8, 9, 10, 3]


def test_all_decode_step_is_one_batched_call(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    cache = paged_cache(1, HKV, D, num_blocks=16, block_size=4)
    tables = scattered_tables([8, 9, 5], cache)
    decode = step(tables, [4, 7, 2], [1, 1, 1], cache)
    attention(torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), 0, cache, decode)
    mixed = step(tables, [5, 8, 0], [1, 1, 5], cache)
    attention(torch.randn(7, HQ, D), torch.randn(7, HKV, D), torch.randn(7, HKV, D), 0, cache, mixed)
    assert calls == [(3, HQ, 1, D), (2, HQ, 1, D), (1, HQ, 5, D)]  # decodes batched, one prefill


def test_cuda_backends_never_include_cudnn():
    from torch.nn.attention import SDPBackend

    assert SDPBackend.CUDNN_ATTENTION not in CUDA_BACKENDS and SDPBackend.FLASH_ATTENTION in CUDA_BACKENDS


def test_prefill_chunks_share_one_call_unless_padding_is_wasteful(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    cache = paged_cache(1, HKV, D, num_blocks=32, block_size=4)
    for past, new in (([0, 2, 0], [5, 4, 6]), ([0, 0, 3], [5, 4, 1]), ([0, 0, 0], [40, 2, 2])):
        st = step(scattered_tables([p + n for p, n in zip(past, new)], cache), past, new, cache)
        t = sum(new)
        attention(torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D), 0, cache, st)
    # three similar chunks: one padded call; two chunks and a decode: two calls; a 40-token chunk
    # beside two 2-token ones: one call each (padding, 3 x 40 x 40, > 2x the useful 40 x 40 + 2 x 4)
    assert calls == [
        (3, HQ, 6, D),
        (1, HQ, 1, D),
        (2, HQ, 5, D),
        (1, HQ, 40, D),
        (1, HQ, 2, D),
        (1, HQ, 2, D),
    ]


@pytest.mark.parametrize("masked", [True, False])
def test_decode_grouped_equals_grouped_query_sdpa(masked):
    """CUDA's decode layout (each KV head's query heads as query rows, no ``enable_gqa``) gives
    grouped-query SDPA's output, with a ragged length mask and with none (every context full)."""
    from moe_runtime.layers.attention import decode_grouped

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, c, d = 3, 8, 2, 11, 16
    q = torch.randn(b, hq, d, generator=g)
    keys, vals = torch.randn(2, b, hkv, c, d, generator=g)
    lens = torch.tensor([11, 4, 7]) if masked else torch.full((b,), c)
    visible = (torch.arange(c)[None, :] < lens[:, None])[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys, vals, attn_mask=visible, enable_gqa=True
    )
    got = decode_grouped(q, keys, vals, visible if masked else None)
    assert got.shape == (b, hq, 1, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_step_context_marks_decodes_of_equal_length():
    """``decode_full``: no length mask is needed when every decode's context is as long as the
    longest (batch 1 always); a ragged batch keeps the mask."""
    cache = paged_cache(1, HKV, D, num_blocks=8, block_size=4)
    tables = scattered_tables([7, 7], cache)
    even = step(tables, [6, 6], [1, 1], cache)
    ragged = step(tables, [6, 3], [1, 1], cache)
    assert even.decode_full and not ragged.decode_full
    assert bool(ragged.decode_mask[1, 0, 0, 4:].any()) is False
