"""Quantized experts end to end: an FP8 block-scaled checkpoint on disk keeps its experts FP8 in
the host store, the link and the slots and decodes as transformers does on the dequantized
weights; ``--expert-dtype fp8/int8/mxfp4`` quantize an fp32 checkpoint's experts at load, cut the
bytes per expert and decode as transformers does on the round-tripped weights."""

from __future__ import annotations

import pytest
import torch
from quant_models import write_fp8_checkpoint, write_round_trip_reference
from test_runtime_oracle import _run_collecting_logits, greedy_references

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.memory_plan import plan_memory
from moe_runtime.quant.fp8 import Fp8BlockCodec
from moe_runtime.quant.int8 import Int8ChannelCodec
from moe_runtime.quant.mxfp4 import Mxfp4Codec

PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44]]
NEW = 32
#: Both sides compute in fp32 on bit-identical dequantized weights; the only differences are the
#: order of floating-point sums inside attention and matmuls (packed batch vs. one sequence, SDPA
#: vs. eager), a few fp32 ulps per op that grow through 2 layers to ~1e-5 on logits of size ~1.
#: 1e-4 is the bound the unquantized oracle tests use (tests/test_runtime_oracle.py).
ATOL = 1e-4
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def _decode(path, slots, **kw):
    runtime = RuntimeConfig(buffer_slots=slots, max_model_len=128, max_batch_size=2, **kw)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        return _run_collecting_logits(engine, PROMPTS, PARAMS), engine.loaded.store, engine.summary()


def _assert_matches(results, refs):
    for (tokens, logits), (ref_tokens, ref_logits) in zip(results, refs, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoints, tmp_path_factory):
    """(fp8 checkpoint, its dequantized fp32 twin, transformers' references on the twin)."""
    root = tmp_path_factory.mktemp("fp8")
    codec = Fp8BlockCodec((32, 32))  # 48-wide experts: ragged last blocks
    write_fp8_checkpoint(tiny_checkpoints["mixtral"], root / "fp8", codec, root / "deq")
    _, refs = greedy_references(root / "deq", PROMPTS, NEW)
    return root / "fp8", root / "deq", refs


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_checkpoint, slots):
    path, _, refs = fp8_checkpoint
    results, store, summary = _decode(path, slots)
    _assert_matches(results, refs)
    assert store.layout is not None and store.layout.describe() == "fp8 e4m3 block [32, 32]"
    assert store.data.dtype == torch.uint8 and store.expert_nbytes == store.layout.nbytes
    # 3 x 48 x 64 e4m3 bytes plus 3 x 2 x 2 fp32 scales (16-byte aligned), against 4 bytes a weight
    assert store.expert_nbytes == 3 * (48 * 64 + 16)
    assert "experts fp8 e4m3 block [32, 32], 9.05 KiB per expert (36.00 KiB in float32)" in summary


def test_fp8_expert_bytes_are_what_the_link_moves(fp8_checkpoint):
    path, _, _ = fp8_checkpoint
    runtime = RuntimeConfig(buffer_slots=2, max_model_len=128, max_batch_size=2)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        _run_collecting_logits(engine, PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))
        st, nbytes = engine.buffer.stats, engine.loaded.store.expert_nbytes
        fetched = sum(st.demand_fetches)
        assert fetched > 0 and st.demand_bytes == fetched * nbytes
        assert engine.buffer.parts[0].slots.shape == (2, nbytes)
        cfg = engine.config
    assert plan_memory(cfg, runtime).slot_bytes == nbytes


@pytest.mark.parametrize(
    ("expert_dtype", "codec"),
    [("fp8", Fp8BlockCodec((32, 32))), ("int8", Int8ChannelCodec()), ("mxfp4", Mxfp4Codec())],
)
def test_expert_dtype_quantizes_at_load(tiny_checkpoints, tmp_path, expert_dtype, codec):
    src = tiny_checkpoints["qwen3_moe"]
    write_round_trip_reference(src, tmp_path / "ref", codec)
    _, refs = greedy_references(tmp_path / "ref", PROMPTS, NEW)
    _, bf16, _ = _decode(src, 2, expert_dtype="bf16")
    fp32_bytes = bf16.plain_nbytes
    for slots in (None, 2):
        results, store, summary = _decode(src, slots, expert_dtype=expert_dtype)
        _assert_matches(results, refs)
    assert store.layout.codec.name == expert_dtype
    # gate/up [48, 64], down [64, 48]: one byte a weight plus the scales (fp8: 2 x 2 fp32 blocks,
    # int8: one fp32 per row); mxfp4: half a byte a weight, down's 48-wide rows padded to 2 groups
    # of 32, plus one scale byte per group; each component 16-byte aligned
    want = {
        "fp8": 3 * (48 * 64 + 16),
        "int8": 3 * 48 * 64 + 2 * 48 * 4 + 64 * 4,
        "mxfp4": 2 * (48 * 32 + 96) + 64 * 32 + 128,
    }[expert_dtype]
    assert store.expert_nbytes == want
    assert bf16.expert_nbytes == fp32_bytes // 2 == 3 * 48 * 64 * 2
    if expert_dtype != "mxfp4":  # half of bf16's bytes, a quarter of fp32's, plus under 10% scales
        assert bf16.expert_nbytes / 2 < store.expert_nbytes <= bf16.expert_nbytes / 2 * 1.1
    assert f"per expert ({fp32_bytes / 1024:.2f} KiB in float32)" in summary


def test_fp8_checkpoint_with_int8_experts(fp8_checkpoint):
    """--expert-dtype int8 on an fp8 checkpoint: its experts are dequantized at load, then
    quantized to int8 (and its dense layers dequantized): the same bits as int8 experts made from
    the dequantized twin."""
    path, deq, _ = fp8_checkpoint
    got, store, _ = _decode(path, 2, expert_dtype="int8")
    want, _, _ = _decode(deq, 2, expert_dtype="int8")
    assert store.layout.codec.name == "int8"
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits)


@pytest.mark.parametrize("expert_dtype", ["fp8", "mxfp4"])
def test_quantized_paths_and_buffers_identical(tiny_checkpoints, expert_dtype):
    """Quantized experts run the loop path (each used slot dequantized once); the grouped call over
    dequantized slot ranges, the few-token path and any buffer size give the same bits."""
    from test_experts import _logits

    path = tiny_checkpoints["qwen2_moe"]
    ref = _logits(path, "loop", expert_dtype=expert_dtype)
    assert torch.equal(_logits(path, "grouped", expert_dtype=expert_dtype, buffer_slots=5), ref)
    assert torch.equal(_logits(path, "loop", expert_dtype=expert_dtype, buffer_slots=2, few_tokens=3), ref)
    with LLMEngine.from_pretrained(
        path, RuntimeConfig(max_model_len=32, expert_dtype=expert_dtype)
    ) as engine:
        assert engine.model.expert_path == "loop"


def test_mxfp4_checkpoint_through_the_generic_hook(tiny_checkpoints, tmp_path):
    """An MXFP4 checkpoint in gpt-oss's on-disk form (fused ``*_blocks`` / ``*_scales`` experts):
    paired by suffix, the base name classified as the fused expert tensor, its packed rows split
    into gate and up (transformers' order: gate rows first) and kept as stored; decodes as
    transformers on the dequantized weights."""
    from quant_models import write_mxfp4_checkpoint

    write_mxfp4_checkpoint(tiny_checkpoints["qwen3_moe"], tmp_path / "mx", tmp_path / "ref")
    _, refs = greedy_references(tmp_path / "ref", PROMPTS, NEW)
    for slots in (None, 2):
        results, store, _ = _decode(tmp_path / "mx", slots)
        _assert_matches(results, refs)
    assert store.layout.codec.name == "mxfp4" and store.expert_nbytes == 2 * (48 * 32 + 96) + 64 * 32 + 128
