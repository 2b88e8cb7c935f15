"""gpt-oss served from an MXFP4 checkpoint in the Hub's on-disk format, against transformers
loading the very same files (``Mxfp4Config(dequantize=True)``: its CPU path, which dequantizes the
experts with ``integrations.mxfp4.convert_moe_packed_tensors``).

The checkpoint is the tiny gpt-oss of ``tests/tiny_models.py`` (experts 64 wide, so every MXFP4
group of 32 is whole, as in gpt-oss-20b) with its experts quantized by the repo's codec into
``*_blocks`` / ``*_scales`` (``tests/quant_models.py``). Checked: transformers reads our files into
the weights our codec dequantizes (so the layout, orientation and gate/up interleave are
transformers'); the store holds the checkpoint's packed bytes unchanged (no dequantize/re-quantize
round trip) in slots of the MXFP4 size; greedy tokens and logits equal transformers' for one prompt
and a batch of four, all resident and at a 2-slot buffer; ``--expert-dtype bf16`` dequantizes at
load; a missing scale tensor and another quantization method are refused in one line (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import transformers
from quant_models import GPT_OSS_MXFP4, write_gpt_oss_mxfp4_checkpoint
from safetensors.torch import load_file, save_file
from test_cli_errors import assert_one_line, run_cli
from test_gpt_oss import GPT_OSS_20B, GREEDY, NEW, PROMPTS, RUNTIME
from test_runtime_oracle import _run_collecting_logits, assert_matches, check_buffer_stats, greedy_references
from tiny_models import make_gpt_oss_checkpoint, write_tokenizer

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.loader import read_model_config
from moe_runtime.memory_plan import plan_memory
from moe_runtime.models import FAMILIES
from moe_runtime.models.gpt_oss import FAMILY
from moe_runtime.quant.mxfp4 import Mxfp4Codec

#: expert width: a multiple of 32 (whole MXFP4 groups; transformers does not crop padding)
INTERMEDIATE = 64
HIDDEN = 64
#: Both sides compute in fp32 on the same dense weights and on expert weights that are equal bit
#: for bit (test_transformers_reads_our_layout); what is left is the order of floating-point sums
#: (packed batches vs. one sequence, SDPA vs. eager attention), a few fp32 ulps per op, ~1e-5 on
#: logits of size ~1 after 3 layers: the bound of the unquantized gpt-oss test (test_gpt_oss.py).
ATOL = 1e-4
DEQUANTIZE = transformers.Mxfp4Config(dequantize=True)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 checkpoint folder, its tensors, transformers' model on it, references per prompt)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    src = make_gpt_oss_checkpoint(root / "fp32", intermediate_size=INTERMEDIATE)
    path = root / "mxfp4"
    tensors = write_gpt_oss_mxfp4_checkpoint(src, path)
    write_tokenizer(path)
    model, refs = greedy_references(path, PROMPTS, NEW, quantization_config=DEQUANTIZE)
    return path, tensors, model, refs


def _engine(path, slots=None, **kw):
    return LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=slots, **RUNTIME, **kw))


def test_transformers_reads_our_layout(mxfp4):
    """transformers dequantizes our ``*_blocks``/``*_scales`` into its ``[E, in, out]`` parameters
    equal to our codec's values, and the loader's per-part split (gate = even rows, up = odd rows,
    on the packed bytes) serves exactly transformers' gate, up and down of every expert."""
    path, tensors, model, _ = mxfp4
    codec = Mxfp4Codec()
    with _engine(path) as engine:
        store = engine.loaded.store
        for layer, block in enumerate(model.model.layers):
            experts = block.mlp.experts
            for name, out in (("gate_up_proj", 2 * INTERMEDIATE), ("down_proj", HIDDEN)):
                stem = f"model.layers.{layer}.mlp.experts.{name}"
                parts = {c: tensors[f"{stem}_{c}"] for c in ("blocks", "scales")}
                ours = codec.dequantize(parts, out, parts["blocks"].shape[-2] * 32, torch.float32)
                assert torch.equal(getattr(experts, name).data, ours.transpose(1, 2))
            for e in range(engine.config.num_experts):
                gate_up = experts.gate_up_proj[e].detach()
                assert torch.equal(store.dequant(layer, e, "gate"), gate_up[:, 0::2].T)
                assert torch.equal(store.dequant(layer, e, "up"), gate_up[:, 1::2].T)
                assert torch.equal(store.dequant(layer, e, "down"), experts.down_proj[e].detach().T)


def test_experts_stay_as_shipped(mxfp4):
    """The host store holds each expert's packed bytes and scales exactly as the checkpoint has
    them (no round trip), in rows of the MXFP4 size: per ``[out, in]`` matrix ``out * in / 2``
    bytes of e2m1 pairs plus ``out * in / 32`` e8m0 scale bytes; the slots, the memory plan and
    the bytes moved follow from it."""
    path, tensors, _, _ = mxfp4
    runtime = RuntimeConfig(buffer_slots=2, **RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        _run_collecting_logits(engine, PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))
        store, layout, stats = engine.loaded.store, engine.loaded.store.layout, engine.buffer.stats
        assert layout is not None and layout.codec.name == "mxfp4" and store.data.dtype == torch.uint8
        for layer in range(engine.config.num_layers):
            p = f"model.layers.{layer}.mlp.experts."
            for e in range(engine.config.num_experts):
                row = store.data[store.key(layer, e)]
                for comp in ("blocks", "scales"):
                    gate_up = tensors[f"{p}gate_up_proj_{comp}"][e]
                    assert torch.equal(layout.view(row, "gate", comp), gate_up[0::2])
                    assert torch.equal(layout.view(row, "up", comp), gate_up[1::2])
                    assert torch.equal(layout.view(row, "down", comp), tensors[f"{p}down_proj_{comp}"][e])
        matrix = INTERMEDIATE * HIDDEN  # gate, up and down alike; 2176 bytes, 16-byte aligned
        assert store.expert_nbytes == 3 * (matrix // 2 + matrix // 32)
        assert engine.buffer.parts[0].slots.shape == (2, store.expert_nbytes)
        assert plan_memory(engine.config, runtime).slot_bytes == store.expert_nbytes
        assert stats.demand_bytes == sum(stats.demand_fetches) * store.expert_nbytes > 0
        assert "experts mxfp4 (e2m1, e8m0 scale per 32), 6.38 KiB per expert" in engine.summary()


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
def test_greedy_tokens_and_logits_match_transformers(mxfp4, slots):
    path, _, _, refs = mxfp4
    with _engine(path, slots) as engine:
        single = _run_collecting_logits(engine, PROMPTS[:1], GREEDY)
        batch = _run_collecting_logits(engine, PROMPTS, GREEDY)
        stats = engine.buffer.stats
    assert_matches(single + batch, refs[:1] + refs, atol=ATOL)
    check_buffer_stats(stats, slots)


def test_expert_dtype_bf16_dequantizes_at_load(mxfp4):
    """``--expert-dtype bf16``: experts dequantized at load and kept bf16 (twice MXFP4's bytes and
    more); every e2m1 value times a power of two is exact in bf16, so the served weights and the
    tokens are the same."""
    path, _, _, refs = mxfp4
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with _engine(path, 2) as mx, _engine(path, 2, expert_dtype="bf16") as bf16:
        store = bf16.loaded.store
        assert store.layout.codec.name == "bf16" and store.expert_nbytes == 3 * INTERMEDIATE * HIDDEN * 2
        for part in ("gate", "up", "down"):
            assert torch.equal(store.dequant(2, 5, part), mx.loaded.store.dequant(2, 5, part))
        got = _run_collecting_logits(bf16, PROMPTS, params)
    assert_matches(got, [(tokens[:8], logits[:8]) for tokens, logits in refs], atol=ATOL)


def _copy(path, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def test_missing_scales_named(capsys, mxfp4, tmp_path):
    path = _copy(mxfp4[0], tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    rc, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "x", "--max-tokens", "2")
    assert_one_line(rc, err, f"missing tensor {name}")


def test_other_quant_method_refused(capsys, mxfp4, tmp_path):
    path = _copy(mxfp4[0], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "x", "--max-tokens", "2")
    assert_one_line(rc, err, "config.json", "quant_method 'fp8' is not supported for gpt-oss")


def test_families_hashable_with_suffixes():
    assert all(hash(f) == hash(dataclasses.replace(f)) for f in FAMILIES.values())
    own = dataclasses.replace(FAMILY, quantized_suffixes=(("mxfp4", (("blocks", "_b"), ("scales", "_s"))),))
    assert hash(own) != hash(FAMILY) and own.suffixes_for("mxfp4") == {"blocks": "_b", "scales": "_s"}


def test_released_mxfp4_config_plans_mxfp4_slots(tmp_path):
    """gpt-oss-20b's config.json with its own ``quantization_config``: parsed as mxfp4, and with
    ``--expert-dtype auto`` a slot and a store row are the MXFP4 size of its 2880 x 2880 experts
    (12.6 MiB, against 47.5 MiB in bf16)."""
    config = {**GPT_OSS_20B, "quantization_config": GPT_OSS_MXFP4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, cfg, _ = read_model_config(tmp_path)
    assert cfg.quant_method == "mxfp4"
    matrix = 2880 * 2880
    for expert_dtype, nbytes in (("auto", 3 * (matrix // 2 + matrix // 32)), ("bf16", 3 * matrix * 2)):
        plan = plan_memory(cfg, RuntimeConfig(dtype="bf16", buffer_slots=8, expert_dtype=expert_dtype))
        assert plan.slot_bytes == nbytes and plan.expert_store == 24 * 32 * nbytes


@pytest.mark.parametrize(
    ("scale", "dtype", "ok"), [(127 + 125, "fp32", True), (255, "fp32", False), (127 + 14, "fp16", False)]
)
def test_overflowing_scale_named(capsys, mxfp4, tmp_path, scale, dtype, ok):
    """The load's finite check, taken from the scales when they bound every value: 6 x 2^125
    fits fp32; a group of 6.0s at scale 2^128 (the e8m0 NaN code, which transformers'
    ``ldexp`` turns into Inf) or at 2^14 in fp16 (98304) does not, and the tensor is named."""
    path = _copy(mxfp4[0], tmp_path)
    stem = "model.layers.2.mlp.experts.down_proj"
    tensors = load_file(str(path / "model.safetensors"))
    tensors[f"{stem}_blocks"][3, 7, 1] = 0x77  # 16 bytes = 32 values of 6.0
    tensors[f"{stem}_scales"][3, 7, 1] = scale
    save_file(tensors, str(path / "model.safetensors"))
    rc, err = run_cli(
        capsys, "generate", "--model", str(path), "--dtype", dtype, "--prompt", "x", "--max-tokens", "1"
    )
    if ok:
        assert rc == 0, err
    else:
        assert_one_line(rc, err, f"tensor {stem}", "Inf" if dtype == "fp32" else "overflow")
