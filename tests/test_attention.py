"""Attention over a packed mixed step: decodes batched in one call, prefill chunks (fresh or with a
past) causal; every token's output equals a plain softmax attention over its own sequence."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.engine.context import StepContext
from moe_runtime.layers.attention import CUDA_BACKENDS, attention
from moe_runtime.layers.kv_cache import KVCache

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


def test_mixed_step_matches_per_sequence_attention():
    torch.manual_seed(0)
    cache = KVCache(1, 5, HKV, 32, D, torch.float32, torch.device("cpu"))
    # rows 0..3: a decode (past 9), a prefill chunk with a past (past 5, 4 new), a fresh prompt
    # (6 new), another decode (past 3); row 4 unused
    rows, past, new = [2, 0, 3, 1], [9, 5, 0, 3], [1, 4, 6, 1]
    history = {r: (torch.randn(p, HKV, D), torch.randn(p, HKV, D)) for r, p in zip(rows, past)}
    for r, (k, v) in history.items():
        cache.k[0][r, :, : k.shape[0]] = k.transpose(0, 1)
        cache.v[0][r, :, : v.shape[0]] = v.transpose(0, 1)
    step = StepContext.build(["a", "b", "c", "d"], rows, past, new, [True] * 4, torch.device("cpu"))
    assert not step.all_decode and step.prefill_seqs == [1, 2]
    assert step.prefill_mask is not None  # both prefill chunks in one padded call
    t = sum(new)
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    got = attention(q, k, v, 0, cache, step)
    for i, r in enumerate(rows):
        a, n = step.starts[i], new[i]
        keys = torch.cat([history[r][0], k[a : a + n]])
        vals = torch.cat([history[r][1], v[a : a + n]])
        want = _reference(q[a : a + n], keys, vals, past[i])
        torch.testing.assert_close(got[a : a + n].double(), want, atol=1e-5, rtol=0)


def test_all_decode_step_is_one_batched_call(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    cache = KVCache(1, 3, HKV, 16, D, torch.float32, torch.device("cpu"))
    step = StepContext.build(
        ["a", "b", "c"], [0, 1, 2], [4, 7, 2], [1, 1, 1], [True] * 3, torch.device("cpu")
    )
    attention(torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), 0, cache, step)
    mixed = StepContext.build(
        ["a", "b", "c"], [0, 1, 2], [5, 8, 0], [1, 1, 5], [True] * 3, torch.device("cpu")
    )
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
    cache = KVCache(1, 3, HKV, 64, D, torch.float32, torch.device("cpu"))
    cpu = torch.device("cpu")
    for past, new in (([0, 2, 0], [5, 4, 6]), ([0, 0, 3], [5, 4, 1]), ([0, 0, 0], [40, 2, 2])):
        step = StepContext.build(["a", "b", "c"], [0, 1, 2], past, new, [True] * 3, cpu)
        t = sum(new)
        attention(torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D), 0, cache, step)
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
    cpu = torch.device("cpu")
    even = StepContext.build(["a", "b"], [0, 1], [6, 6], [1, 1], [True] * 2, cpu)
    ragged = StepContext.build(["a", "b"], [0, 1], [6, 3], [1, 1], [True] * 2, cpu)
    assert even.decode_full and not ragged.decode_full
    assert bool(ragged.decode_mask[1, 0, 0, 4:].any()) is False
