"""The decoder layer's fused pieces: q/k/v (and a dense MLP's gate/up) fused at load, and the
CPU's matmul weights laid out column-major, without changing the dense dict's names, values or
bytes; RoPE turned in place over queries and keys with the reference's bits; the KV cache's keys
and values side by side, written with one op."""

from __future__ import annotations

import torch

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.layers.kv_cache import KVLayout, PagedKVCache
from moe_runtime.layers.rotary import Rotary
from moe_runtime.loader import load_checkpoint


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_fusion_keeps_the_dense_names_values_and_bytes(tiny_checkpoints):
    for path in (default_model_dir(), tiny_checkpoints["qwen2_moe"], tiny_checkpoints["olmoe"]):
        runtime = RuntimeConfig(max_model_len=32)
        ref = load_checkpoint(path, runtime).dense
        with LLMEngine.from_pretrained(path, runtime) as engine:
            dense, layer = engine.model.w, engine.model.layers[0]
            assert set(dense) == set(ref)
            assert all(torch.equal(dense[k], ref[k]) for k in ref)
            assert sum(t.numel() for t in dense.values()) == sum(t.numel() for t in ref.values())
            # q, k and v are views of the one projection the layer runs
            assert dense["layers.0.q"].data_ptr() == layer.qkv.data_ptr()
            assert dense["layers.0.o"].data_ptr() == layer.o_t.data_ptr()
            # on the CPU the matmul weights are laid out column-major (model.COLUMN_MAJOR)
            assert layer.qkv.t().is_contiguous() and engine.model.lm_head.t().is_contiguous()
            assert dense["layers.1.router"].t().is_contiguous()


def test_rotate_in_place_is_the_reference_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        for rotary_dim in (None, 16):  # full and partial (GLM-4.5) rotary
            rot = Rotary(32, 10000.0, 64, dtype, torch.device("cpu"), rotary_dim)
            d = rot.dim
            pos = torch.tensor([0, 5, 63])
            x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
            cos, sin = rot.cos[pos][:, None], rot.sin[pos][:, None]
            turned = x[..., :d] * cos + _rotate_half(x[..., :d]) * sin
            want = torch.cat((turned, x[..., d:]), dim=-1)
            got = x.clone()
            rot.rotate_(got, *rot.rows(pos))
            assert torch.equal(got, want), (dtype, rotary_dim)


def test_keys_and_values_side_by_side():
    layout = KVLayout.build(2, 4, 2 * 2 * 8, 1 << 10)
    cache = PagedKVCache(layout, 6, 2, 8, torch.float32, torch.device("cpu"))
    kv = torch.randn(3, 4, 1, 8)  # 3 tokens: 2 key heads, then 2 value heads
    slots = torch.tensor([5, 0, 13])
    cache.kv_flat[1].index_copy_(0, slots, kv)  # one op writes both
    assert torch.equal(cache.k_flat[1][slots], kv[:, :2, 0])
    assert torch.equal(cache.v_flat[1][slots], kv[:, 2:, 0])
    assert torch.equal(cache.k[1][3, 1], kv[2, :2, 0])  # slot 13 = block 3, offset 1
    assert cache.k_flat[0].abs().sum() == 0 and cache.nbytes == 2 * 6 * 4 * 2 * 2 * 8 * 4
