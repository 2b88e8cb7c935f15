"""Grouped-query SDPA calls that CUDA's flash kernel cannot take (a mask, head dims above 256) get
their K/V heads repeated to the query heads (``attention.sdpa_gqa``), so that the
memory-efficient kernel runs them instead of the math fallback and its fp32 ``[B, Hq, Lq, C]``
scores. On the CPU the tests switch CUDA's choice on (``attention.EXPAND_GQA``) and check that
the values do not change and that no masked call is left with fewer K/V heads than query heads,
over the engine's paths: chunks with a cached prefix, padded prefills, sliding windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_gpt_oss_checkpoint

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.layers import attention


class _Spy:
    """Records ``(query heads, K/V heads, masked, enable_gqa)`` of every SDPA call with more than one
    query row (one-query decodes run ``decode_grouped`` or FlexAttention on CUDA, the CPU's own
    batched call here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool, bool]] = []
        self._real = F.scaled_dot_product_attention

    def __call__(self, q, k, v, attn_mask=None, **kwargs):
        if q.shape[-2] > 1:
            self.calls.append(
                (q.shape[-3], k.shape[-3], attn_mask is not None, bool(kwargs.get("enable_gqa")))
            )
        return self._real(q, k, v, attn_mask=attn_mask, **kwargs)


@pytest.fixture
def cuda_choice(monkeypatch) -> _Spy:
    spy = _Spy()
    monkeypatch.setitem(attention.EXPAND_GQA, "cpu", True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return spy


def _qkv(hq: int, hkv: int, lq: int, c: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, hq, lq, d, generator=gen), *(torch.randn(1, hkv, c, d, generator=gen) for _ in "kv")


@pytest.mark.parametrize(
    ("d", "kwargs", "repeated"),
    [
        (16, {"attn_mask": torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)}, True),
        (288, {"is_causal": True}, True),  # above the flash kernel's head dims
        (16, {"is_causal": True}, False),  # the flash kernel takes GQA itself
    ],
)
def test_repeated_heads_equal_native_gqa(cuda_choice, d, kwargs, repeated):
    lq, c = (5, 9) if "attn_mask" in kwargs else (9, 9)
    q, k, v = _qkv(8, 2, lq, c, d)
    want = cuda_choice._real(q, k, v, enable_gqa=True, **kwargs)
    got = attention.sdpa_gqa(q, k, v, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    (call,) = cuda_choice.calls
    assert call == ((8, 8, "attn_mask" in kwargs, False) if repeated else (8, 2, False, True))


def test_sinks_by_padding_with_repeated_heads(cuda_choice):
    """The sink-as-extra-key route (CUDA's) gives the same values with its heads repeated."""
    q, k, v = _qkv(4, 2, 5, 9, 16)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    visible = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    got = attention._sinks_by_padding(q, k, v, visible, sinks)
    attention.EXPAND_GQA["cpu"] = False  # restored by monkeypatch
    want = attention._sinks_by_padding(q, k, v, visible, sinks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert cuda_choice.calls[0][:2] == (4, 4) and cuda_choice.calls[1][:2] == (4, 2)


def _serve(model, prompts, max_tokens=6):
    """Greedy tokens of ``prompts`` sent together, then the first one again (a prefix-cache hit:
    its chunk attends over cached blocks under a mask)."""
    rt = RuntimeConfig(max_model_len=96, max_batch_size=4, dtype="fp32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLMEngine.from_pretrained(model, rt) as engine:
        first = [o.output_token_ids for o in engine.generate(prompts, params)]
        again = engine.generate(prompts[:1], params)[0].output_token_ids
    return first, again


PROMPTS = [list(range(5, 45)), list(range(7, 20)), [3, 9, 27, 81 % 50, 11]]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_engine_masked_calls_have_whole_heads_and_the_same_tokens(
    family, tiny_qwen3, tmp_path_factory, monkeypatch
):
    model = tiny_qwen3 if family == "qwen3_moe" else make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gqa"))
    want = _serve(model, PROMPTS)
    spy = _Spy()
    monkeypatch.setitem(attention.EXPAND_GQA, "cpu", True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    assert _serve(model, PROMPTS) == want
    masked = [c for c in spy.calls if c[2]]
    if family == "qwen3_moe":  # gpt-oss's masked calls go to the CPU's own sink kernel
        assert masked, spy.calls
    assert all(hq == hkv for hq, hkv, _, _ in masked), masked
