"""The CUDA decode path that reads paged blocks in place (FlexAttention), checked on the CPU.

No GPU here: FlexAttention runs eagerly (its unfused reference, which applies the ``mask_mod`` to
every key), so these tests check what a GPU run would rely on: the block mask built from the block
tables, the logical positions behind each physical block, the length and sliding-window masks,
sinks through the returned log-sum-exp, int32 metadata in fixed-shape buffers padded to the batch
size, and which models take the path at all (the choice named in the load summary).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from paged_helpers import paged_cache, scattered_tables, step, write

from moe_runtime.layers import paged_decode
from moe_runtime.layers.attention import attention
from moe_runtime.layers.paged_decode import FlexPagedDecode, decode_path

pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

HQ, HKV, D = 8, 2, 16
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_decode_path_choice(monkeypatch):
    assert decode_path(torch.device("cpu"), 32, 8, 128, 16, False)[0] == "gather"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # triton "installed"
    assert decode_path(CUDA, 32, 8, 128, 16, False) == (
        "flex",
        "decode reads blocks in place (FlexAttention)",
    )
    assert decode_path(CUDA, 64, 8, 64, 32, False)[0] == "flex"
    why = {
        "latent": decode_path(CUDA, 16, 1, 576, 16, True),
        "block": decode_path(CUDA, 32, 8, 128, 8, False),
        "group": decode_path(CUDA, 96, 8, 128, 16, False),  # GLM-4.5-Air: 12 heads per KV head
        "dim": decode_path(CUDA, 32, 8, 96, 16, False),
    }
    assert all(path == "gather" for path, _ in why.values())
    assert "latent" in why["latent"][1] and "multiple of 16" in why["block"][1]
    assert "power of two" in why["group"][1] and "head dim 96" in why["dim"][1]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert decode_path(CUDA, 32, 8, 128, 16, False) == (
        "gather",
        "no triton for FlexAttention: blocks gathered",
    )


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_flex_decode_equals_gathered_decode(window, with_sinks):
    """Three decoding sequences (contexts 11, 4 and 17, blocks of 4 scattered over the pool) of a
    batch padded to 5: FlexAttention over the whole pool with the block mask equals the gathered
    SDPA path, window and sinks included."""
    torch.manual_seed(0)
    windows = {0: window} if window else None
    cache = paged_cache(1, HKV, D, num_blocks=24, block_size=4, windows=windows)
    ctx = [11, 4, 17]
    tables = scattered_tables(ctx, cache, seed=3)
    for t, n in zip(tables, ctx):
        write(cache, 0, t[0], 0, torch.randn(n - 1, HKV, D), torch.randn(n - 1, HKV, D))
    st = step(tables, [n - 1 for n in ctx], [1, 1, 1], cache)
    q, k, v = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    sinks = torch.randn(HQ) if with_sinks else None
    want = attention(q, k, v, 0, cache, st, sinks).view(3, HQ, D)  # writes k, v, then gathers
    flex = FlexPagedDecode(
        24, 4, max_seqs=5, max_blocks=8, num_groups=1, device=torch.device("cpu"), compiled=False
    )
    got = flex.decode(q, cache.k_flat[0], cache.v_flat[0], st, 0, window, sinks)
    assert got.shape == (3, HQ, 1, D)
    torch.testing.assert_close(got[:, :, 0], want, atol=1e-5, rtol=0)
    buf = flex.groups[0]
    assert buf.kv_num.dtype == buf.kv_idx.dtype == buf.logical.dtype == torch.int32
    assert buf.kv_num.shape == (5, 1, 1) and buf.kv_idx.shape == (5, 1, 1, 8)
    first = [max(0, n - window) // 4 for n in ctx] if window else [0, 0, 0]
    assert buf.kv_num[:, 0, 0].tolist() == [-(-n // 4) - f for n, f in zip(ctx, first)] + [0, 0]
    row = tables[2][0]
    assert buf.kv_idx[2, 0, 0, : len(row) - first[2]].tolist() == row[first[2] :]
    assert buf.logical[2, row[-1]].item() == len(row) - 1 and buf.logical[3].eq(-1).all()


def test_flex_buffers_are_loaded_once_per_step(monkeypatch):
    """Every layer of a step reuses the group's buffers (``step.cached``); the mask is built once."""
    cache = paged_cache(2, HKV, D, num_blocks=8, block_size=4)
    tables = scattered_tables([6, 3], cache)
    st = step(tables, [5, 2], [1, 1], cache)
    flex = FlexPagedDecode(
        8, 4, max_seqs=2, max_blocks=2, num_groups=1, device=torch.device("cpu"), compiled=False
    )
    mask = flex.groups[0].mask
    loads = []
    real = flex.load
    monkeypatch.setattr(flex, "load", lambda *a: loads.append(a) or real(*a))
    for layer in range(2):
        flex.decode(torch.randn(2, HQ, D), cache.k_flat[layer], cache.v_flat[layer], st, 0, None)
    assert len(loads) == 1 and flex.groups[0].mask is mask
    assert paged_decode._compiled is None  # nothing compiled on the CPU
