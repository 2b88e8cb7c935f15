"""gpt-oss against transformers' own GptOssForCausalLM (the oracle).

A tiny checkpoint with non-default settings (``tests/tiny_models.py``: sliding window 4, shorter
than the prompts, layers alternating sliding and full attention, 6 experts top-2, random attention
sinks and router/expert biases, YaRN RoPE without truncation, a SwiGLU clamp that bites): greedy
tokens equal and fp32 logits within 1e-4 at every step for 32 new tokens, for one prompt and a
batch of four prompts of different lengths, every expert resident and at a 2-slot buffer; chunked
prefill and a request joining mid-decode; prompts 4-5x the window (whole, in chunks shorter and
longer than the window); the grouped, loop and few expert paths bit-identical; the sliding
layers' block group holds only the blocks a window still covers (the kernel-level attention tests
are in ``tests/test_window_attention.py``).
Also: removing any gpt-oss piece (sinks, window, biases, clamp) moves the logits far beyond the
tolerance, so the comparisons above depend on each; the RoPE tables and the router equal
transformers'; the memory plan counts the new dense tensors; bad config fields are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_experts import _logits
from test_runtime_oracle import (
    _run_collecting_logits,
    assert_matches,
    check_buffer_stats,
    greedy_references,
    join_mid_decode,
)
from tiny_models import make_gpt_oss_checkpoint

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.errors import CheckpointError, ConfigError
from moe_runtime.layers import attention
from moe_runtime.layers.kv_cache import KVLayout, PagedKVCache
from moe_runtime.layers.norm import rms_norm
from moe_runtime.layers.rotary import Rotary
from moe_runtime.layers.router_lookahead import RouterLookahead
from moe_runtime.layers.routing import route
from moe_runtime.loader import read_model_config
from moe_runtime.memory_plan import plan_memory

PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109], [77]]
NEW = 32
ATOL = 1e-4
RUNTIME = dict(max_model_len=64, max_batch_size=4)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(checkpoint folder, transformers model, [(tokens, step logits [NEW, V])] per prompt)."""
    path = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "tiny")
    return (path, *greedy_references(path, PROMPTS, NEW))


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
def test_greedy_tokens_and_logits_match_transformers(gpt_oss, slots):
    path, _, refs = gpt_oss
    with LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=slots, **RUNTIME)) as engine:
        single = _run_collecting_logits(engine, PROMPTS[:1], GREEDY)
        batch = _run_collecting_logits(engine, PROMPTS, GREEDY)
        stats = engine.buffer.stats
        lookahead = engine.model.lookahead
    assert_matches(single + batch, refs[:1] + refs)
    check_buffer_stats(stats, slots)
    assert (lookahead is not None) == (slots == 2)  # the eam prefetch (offloading only) ran it


def test_chunked_prefill_and_mixed_steps(gpt_oss):
    """Prompts prefilled in chunks of 3 tokens (a chunk's window reaches into the cached past) and
    a request joining while another decodes still give transformers' tokens."""
    path, _, refs = gpt_oss
    runtime = RuntimeConfig(buffer_slots=3, max_num_batched_tokens=3, **RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        finals = join_mid_decode(engine, PROMPTS[2], PROMPTS[0], GREEDY)
    assert finals == {"a": refs[2][0], "b": refs[0][0]}


LONG = [
    [(7 * i + 3) % 300 for i in range(22)],
    [(11 * i + 5) % 300 for i in range(17)],
]  # 5.5 and 4.25 windows


@pytest.fixture(scope="module")
def long_refs(gpt_oss):
    """transformers' greedy tokens and step logits for :data:`LONG`, 12 new tokens each."""
    return greedy_references(gpt_oss[0], LONG, 12)[1]


@pytest.mark.parametrize(
    "chunk, block_size", [(None, 16), (3, 2), (9, 4)], ids=["whole", "chunks-3", "chunks-9"]
)
def test_prompts_several_windows_long(gpt_oss, long_refs, chunk, block_size):
    """Prompts 4-5x the window (the sliding layers free blocks as the window moves on), prefilled
    whole or in chunks shorter and longer than the window, then decoded as a batch of two
    different lengths, give transformers' tokens and logits; the sliding layers form their own
    block group, whose blocks hold the two sliding layers' keys."""
    runtime = RuntimeConfig(
        buffer_slots=2, max_num_batched_tokens=chunk or 64, block_size=block_size, **RUNTIME
    )
    with LLMEngine.from_pretrained(gpt_oss[0], runtime) as engine:
        results = _run_collecting_logits(
            engine, LONG, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
        kv, summary = engine.kv, engine.summary()
    assert_matches(results, long_refs)
    assert "2 sliding layers keep their 4-token window" in summary
    assert kv.sliding == {0: 4, 2: 4} and kv.layout.group_of == (1, 0, 1) and kv.layout.slots == 2


def test_sliding_blocks_are_freed(gpt_oss):
    """With 2-token blocks, a sequence's sliding-window group holds only the blocks the windows of
    its step's queries cover (the others are freed, NULL in its table, when it is next scheduled)
    while the full group holds every block; the pool gets them all back at the end."""
    runtime = RuntimeConfig(block_size=2, max_num_batched_tokens=5, **RUNTIME)
    held = []
    with LLMEngine.from_pretrained(gpt_oss[0], runtime) as engine:
        manager = engine.kv_manager
        engine.add_request("a", LONG[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        past = 0
        while engine.has_unfinished():
            engine.step()
            seq = engine.scheduler.running[0] if engine.scheduler.running else None
            if seq is None:
                continue
            full, sliding = manager.tables(seq)[0], manager.tables(seq)[1]
            assert len(full) == len(sliding) and -1 not in full
            live = [b for b in sliding if b != -1]
            # blocks from the one holding position past - 3 (the step's first query's window)
            assert len(live) == len(sliding) - max(0, past - 3) // 2
            held.append(len(live))
            past = seq.num_computed
        assert manager.num_free == manager.num_blocks
    assert max(held) <= 5 and len(sliding) >= 16  # 3 positions of window + a step's 5 tokens, of 17 blocks


def test_padded_prefill_of_two_prompts(gpt_oss):
    """Two prompts of similar length prefill in one padded SDPA (windowed, with sinks): tokens and
    logits still equal transformers'."""
    path, _, refs = gpt_oss
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with (
        mock.patch.object(attention, "_prefill_padded", wraps=attention._prefill_padded) as padded,
        mock.patch.object(attention, "_window_group", wraps=attention._window_group) as window_group,
        LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine,
    ):
        results = _run_collecting_logits(engine, [PROMPTS[0], PROMPTS[2]], params)
    cfg = engine.config
    assert padded.call_count == cfg.num_layers - len(cfg.sliding_layers)  # the prefill step, full layers
    assert window_group.call_args_list[0].args[2] == [0, 1]  # both chunks in one group over the windows
    assert_matches(results, [(tokens[:8], logits[:8]) for tokens, logits in (refs[0], refs[2])])


def test_expert_paths_bit_identical(gpt_oss):
    """The per-expert biases and the clamped SwiGLU give the same bits on the grouped, loop and
    few paths, resident and at a 2-slot buffer."""
    path = gpt_oss[0]
    ref = _logits(path, "loop")
    assert torch.equal(_logits(path, "grouped"), ref)
    assert torch.equal(_logits(path, "grouped", buffer_slots=2), ref)
    assert torch.equal(_logits(path, "grouped", few_tokens=3, buffer_slots=2), ref)


def _without(engine, piece: str) -> None:
    """Switch one gpt-oss piece off in a loaded engine's model."""
    model = engine.model
    if piece == "sinks":
        for layer in range(engine.config.num_layers):
            model.w.pop(f"layers.{layer}.sinks")
    elif piece == "window":  # every layer in the full-attention block group: no window
        cfg, kv = engine.config, model.kv
        layout = KVLayout.build(cfg.num_layers, kv.block_size, cfg.kv_elements_per_token, 1 << 20)
        model.kv = PagedKVCache(
            layout, kv.num_blocks, cfg.num_kv_heads, cfg.head_dim, torch.float32, kv.k[1].device
        )
    elif piece == "expert biases":
        model.ffn = {
            k: dataclasses.replace(f, gate_up_bias=None, down_bias=None) for k, f in model.ffn.items()
        }
    elif piece == "clamp":
        act = dataclasses.replace(engine.config.expert_act, limit=1e9)
        model.ffn = {k: dataclasses.replace(f, act=act) for k, f in model.ffn.items()}
    else:  # router bias
        for layer in engine.config.moe_layers:
            model.w.pop(f"layers.{layer}.router_logit_bias")


@pytest.mark.parametrize("piece", ["sinks", "window", "expert biases", "clamp", "router bias"])
def test_prefill_logits_need_each_piece(gpt_oss, piece):
    """Prefill logits of a 42-token sequence at a 2-slot buffer equal transformers' forward; without
    the piece they are far from it (so the tests above, at 1e-4, check it)."""
    path, model, refs = gpt_oss
    seq = PROMPTS[2] + refs[2][0]
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=2, **RUNTIME)) as engine:
        torch.testing.assert_close(engine.prefill_logits(seq), want, atol=ATOL, rtol=0)
        _without(engine, piece)
        assert (engine.prefill_logits(seq) - want).abs().max() > 100 * ATOL


def test_rotary_equals_transformers(gpt_oss):
    """The YaRN cos/sin tables (``truncate: false``) rotate q and k exactly as transformers does."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    path, model, _ = gpt_oss
    _, cfg, _ = read_model_config(path)
    assert cfg.yarn is not None and not cfg.yarn.truncate and cfg.rope_theta == 150000.0
    ours = Rotary(cfg.head_dim, cfg.rope_theta, 64, torch.float32, torch.device("cpu"), yarn=cfg.yarn)
    positions = torch.arange(0, 64, 3)
    q = torch.randn(1, 4, len(positions), 16, generator=torch.Generator().manual_seed(1))
    k = torch.randn(1, 2, len(positions), 16, generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ours.apply(q[0].transpose(0, 1), k[0].transpose(0, 1), positions)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_router_and_lookahead_match_transformers(gpt_oss):
    """route() picks transformers' experts with its weights on 256 tokens; the router lookahead's
    logits for layer 1 equal layer 1's biased router on the normed residual."""
    path, model, _ = gpt_oss
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        cfg, w = engine.config, engine.model.w
        router = model.model.layers[1].mlp.router
        x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            _, ref_w, ref_ids = router(x)
        weights, ids = route(x, w["layers.1.router"], cfg, None, w["layers.1.router_logit_bias"])
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=0)
        ahead = RouterLookahead(cfg, w, 1).logits(x, 0)[:, 0]
        want = F.linear(rms_norm(x, w["layers.1.mlp_norm"], cfg.rms_norm_eps), router.weight, router.bias)
        torch.testing.assert_close(ahead, want, atol=1e-5, rtol=0)


def test_lookahead_from_the_attention_norm_keeps_the_router_bias(gpt_oss):
    """The router lookahead handed the attention norm's output (the model's path) adds the later
    routers' biases as the residual's own normalisation does: the same scores."""
    path = gpt_oss[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        cfg, w = engine.config, engine.model.w
        la = RouterLookahead(cfg, w, 1)
        x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
        normed = rms_norm(x, w[f"layers.{cfg.moe_layers[0]}.attn_norm"], cfg.rms_norm_eps)
        assert la.attn_folded[0] is not None and la.biases is not None
        torch.testing.assert_close(la.scores(x, 0, normed=normed), la.scores(x, 0), rtol=1e-4, atol=1e-4)


def test_memory_plan_counts_the_new_dense_tensors(gpt_oss):
    """Sinks, the o bias, the router bias and the expert biases are dense weights the plan counts:
    its dense bytes equal what the loader put on the device."""
    path = gpt_oss[0]
    runtime = RuntimeConfig(**RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        dense = engine.loaded.dense
        assert dense["layers.0.sinks"].shape == (4,) and dense["layers.2.expert_gate_up_bias"].shape == (
            6,
            96,
        )
        plan = plan_memory(engine.config, runtime)
        assert plan.dense == engine.loaded.dense_nbytes and plan.kv_cache == engine.kv.nbytes


def test_bf16_runs(gpt_oss):
    """bf16 weights and activations through the sink mask and the biased experts: finite logits."""
    path = gpt_oss[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(dtype="bf16", buffer_slots=2, **RUNTIME)) as engine:
        ((tokens, logits),) = _run_collecting_logits(
            engine, PROMPTS[2:3], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    assert len(tokens) == 4 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention", "local", "full_attention"]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quant_method"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_parameters.rope_type"),
    ],
)
def test_bad_config_fields_are_named(gpt_oss, tmp_path, change, field):
    shutil.copy(gpt_oss[0] / "config.json", tmp_path / "config.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field):
        read_model_config(tmp_path)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("model.layers.1.mlp.experts.gate_up_proj", "transpose", "gate_up_proj: expected shape"),
        ("model.layers.0.self_attn.sinks", "drop", "missing tensor model.layers.0.self_attn.sinks"),
        ("model.layers.2.mlp.experts.down_proj_bias", "drop", "missing tensor .*down_proj_bias"),
    ],
)
def test_bad_tensors_are_named(gpt_oss, tmp_path, name, change, message):
    """A fused expert tensor in the wrong orientation or a missing sink / expert-bias tensor is
    refused, naming the checkpoint tensor."""
    from safetensors.torch import load_file, save_file

    src = gpt_oss[0]
    tensors = load_file(str(src / "model.safetensors"))
    if change == "drop":
        del tensors[name]
    else:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=message):
        LLMEngine.from_pretrained(tmp_path, RuntimeConfig(**RUNTIME))


GPT_OSS_20B = {  # gpt-oss-20b's config.json (the fields we read), without its quantization_config
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "rms_norm_eps": 1e-05,
    "vocab_size": 201088,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "tie_word_embeddings": False,
}


def test_released_config_parses(tmp_path):
    """gpt-oss-20b's own config format (``rope_scaling`` + ``rope_theta``): every layer MoE, even
    layers sliding, YaRN without truncation, the default SwiGLU alpha."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    _, cfg, _ = read_model_config(tmp_path)
    assert cfg.moe_layers == list(range(24)) and cfg.sliding_layers == list(range(0, 24, 2))
    assert cfg.sliding_window == 128 and cfg.num_experts == 32 and cfg.top_k == 4
    assert cfg.yarn.factor == 32 and cfg.yarn.original_max_position_embeddings == 4096
    assert not cfg.yarn.truncate and cfg.rope_theta == 150000
    assert cfg.expert_act.alpha == 1.702 and cfg.expert_act.limit == 7.0
    assert cfg.o_bias and cfg.attention_sinks and cfg.router_logit_bias and cfg.expert_bias


def test_kv_plan_of_20b_holds_windows_only(tmp_path):
    """At gpt-oss-20b's shape and 4096 tokens, the 12 sliding layers' block group holds a window's
    blocks per sequence: the planned KV cache is 2 sequences x (256 + 9) blocks of 16 tokens and 12
    layers (the full group's 4096 positions, the sliding group's 128 + one block of alignment),
    about half of full-length rows."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    _, cfg, _ = read_model_config(tmp_path)
    plan = plan_memory(cfg, RuntimeConfig(max_model_len=4096, max_batch_size=2, dtype="bf16"))
    per_token_layer = 2 * 8 * 64 * 2  # K and V, 8 KV heads x 64 dims, bf16
    assert plan.kv_cache == 2 * (256 + 9) * 12 * 16 * per_token_layer
    assert 0.51 < plan.kv_cache / (2 * 24 * 4096 * per_token_layer) < 0.52
