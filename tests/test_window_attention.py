"""gpt-oss attention at kernel level against transformers' eager attention: sinks by SDPA's
log-sum-exp and by a padded key, and sliding-window layers over paged blocks that the block manager
frees as the window moves on (chunks longer than the window, single decodes, a mixed step of
different lengths); the window plan and the float masks are built once per step, not per layer."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from paged_helpers import paged_cache
from paged_helpers import step as paged_step

from moe_runtime.engine.kv_manager import KVCacheManager
from moe_runtime.layers import attention


def _eager(q, k, v, sinks, visible):
    """transformers' ``eager_attention_forward`` (GQA 4:2, head dim 16) under a boolean mask
    ``[Lq, C]``: ``[1, Lq, Hq, D]``."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    return eager_attention_forward(module, q, k, v, mask, scaling=16**-0.5)[0]


def _qkv_sinks(n: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h in (4, 2, 2))
    return q, k, v, torch.randn(4, generator=gen)


@pytest.mark.parametrize("route", ["log-sum-exp", "padding"])
def test_sinks_equal_transformers_eager(route):
    """Sinks from SDPA's log-sum-exp (CPU) and as an extra padded key (where no log-sum-exp is
    returned) both equal transformers' eager attention: 5 new queries after 4 cached keys."""
    q, k, v, sinks = _qkv_sinks(9)
    q = q[:, :, 4:]
    prefix = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # the step's causal mask
    want = _eager(q, k, v, sinks, prefix)
    if route == "padding":
        got = attention._sinks_by_padding(q, k, v, prefix, sinks)
    else:
        got = attention._sinks_by_lse(q, k, v, attention._additive(prefix, q.dtype), sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=0)


def _seq(rid: str, total: int) -> SimpleNamespace:
    """What the block manager reads of a sequence of ``total`` tokens."""
    return SimpleNamespace(
        request_id=rid,
        num_computed=0,
        prompt_token_ids=list(range(total)),
        output_token_ids=[],
        num_tokens=total,
        kv_hashes=[],
        params=SimpleNamespace(prompt_logprobs=None),
    )


@pytest.mark.parametrize("chunks", [(4, 5), (9, 3), (2, 1, 1, 5, 1, 1, 1), (12,)])
@pytest.mark.parametrize("block_size", [1, 2, 5])
def test_window_attention_equals_transformers_eager(chunks, block_size):
    """A window-3 layer over paged blocks the manager frees as the window moves on, the tokens fed
    in the given chunks (longer than the window, single decodes), with sinks, equals transformers'
    eager attention with its mask rule (``q - window < kv <= q``) over every key."""
    total = sum(chunks)
    q, k, v, sinks = _qkv_sinks(total)
    cache = paged_cache(1, 2, 16, num_blocks=32, block_size=block_size, windows={0: 3})
    assert cache.windows == (3,) and cache.k[0].shape == (32, block_size, 2, 16)
    manager = KVCacheManager(32, block_size, cache.windows, enable_caching=False)
    seq, outs = _seq("a", total), []
    for n in chunks:
        assert manager.allocate(seq, n)
        st = paged_step([manager.tables(seq)], [seq.num_computed], [n], cache)
        part = (x[0, :, seq.num_computed : seq.num_computed + n].transpose(0, 1) for x in (q, k, v))
        outs.append(attention.attention(*part, 0, cache, st, sinks))
        seq.num_computed += n
    first = max(0, total - chunks[-1] - 2) // block_size  # blocks out of the last chunk's windows
    assert manager.tables(seq)[0][:first] == [-1] * first and -1 not in manager.tables(seq)[0][first:]
    pos, kv = torch.arange(total)[:, None], torch.arange(total)[None, :]
    want = _eager(q, k, v, sinks, (kv <= pos) & (kv > pos - 3))
    torch.testing.assert_close(torch.cat(outs), want.reshape(total, -1), atol=1e-6, rtol=0)


def test_window_mixed_step_and_masks_built_once_per_step(monkeypatch):
    """One step mixing decodes of different lengths with two prefill chunks (one padded call),
    over window-4 blocks of size 2, equals transformers' eager attention per sequence; the step's
    window plan and its float masks are built once for all of its layers."""
    window, layers = 4, 6  # even layers slide
    cache = paged_cache(layers, 2, 16, 48, 2, windows={i: window for i in range(0, layers, 2)})
    manager = KVCacheManager(48, 2, cache.windows, enable_caching=False)
    past, new = [9, 5, 0, 3], [1, 6, 7, 1]
    total = [p + n for p, n in zip(past, new)]
    data = [_qkv_sinks(t, seed=10 + i) for i, t in enumerate(total)]
    sinks = data[0][3]
    seqs = [_seq(str(i), t) for i, t in enumerate(total)]
    pre = [i for i in range(4) if past[i]]  # their history, prefilled first
    for i in pre:
        assert manager.allocate(seqs[i], past[i])
    st = paged_step([manager.tables(seqs[i]) for i in pre], [0] * len(pre), [past[i] for i in pre], cache)
    hist = [torch.cat([data[i][j][0, :, : past[i]].transpose(0, 1) for i in pre]) for j in range(3)]
    for layer in range(layers):
        attention.attention(*hist, layer, cache, st, sinks)
    for i in range(4):
        seqs[i].num_computed = past[i]
        assert manager.allocate(seqs[i], new[i])
    plans = mock.MagicMock(wraps=attention._window_plan)
    masks = mock.MagicMock(wraps=attention._additive)
    monkeypatch.setattr(attention, "_window_plan", plans)
    monkeypatch.setattr(attention, "_additive", masks)
    st = paged_step([manager.tables(s) for s in seqs], past, new, cache)
    assert st.prefill_mask is not None  # the two chunks share one padded call
    now = [torch.cat([data[i][j][0, :, past[i] :].transpose(0, 1) for i in range(4)]) for j in range(3)]
    outs = [attention.attention(*now, layer, cache, st, sinks) for layer in range(layers)]
    assert plans.call_count == 1  # one window: one plan for the three sliding layers
    assert masks.call_count == 4  # decodes and prefills: once over the windows, once over all blocks
    for layer, out in enumerate(outs):
        for i in range(4):
            q, k, v, _ = data[i]
            pos, kv = torch.arange(past[i], total[i])[:, None], torch.arange(total[i])[None, :]
            visible = (kv <= pos) & ((kv > pos - window) if layer % 2 == 0 else True)
            want = _eager(q[:, :, past[i] :], k, v, sinks, visible).reshape(new[i], -1)
            a = st.starts[i]
            torch.testing.assert_close(out[a : a + new[i]], want, atol=1e-6, rtol=0)
