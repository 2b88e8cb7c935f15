"""DeepSeek-V2/V3 against transformers' own DeepseekV2ForCausalLM / DeepseekV3ForCausalLM.

Three tiny variants (``tests/tiny_models.py``: V2 group-limited without q compression; V2 with q
compression, greedy routing and YaRN; V3 noaux_tc with the score bias, renormalised and scaled
weights and YaRN with a softmax mscale), each with a dense first layer and shared experts: greedy
tokens equal and fp32 logits within 1e-4 at every step, for one prompt and for a batch of two
prompts of different lengths, every expert resident and at a 2-slot buffer. Also: the KV cache
holds the latent only, the routers equal transformers' on many tokens, and bad DeepSeek config
fields are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from test_runtime_oracle import (
    check_greedy_matches,
    check_prefill_matches,
    greedy_references,
    join_mid_decode,
)
from tiny_models import DEEPSEEK_VARIANTS, make_deepseek_checkpoint
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ref

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.errors import ConfigError
from moe_runtime.layers.mla import LatentRotary
from moe_runtime.layers.mla_cache import PagedMLACache
from moe_runtime.layers.routing import route
from moe_runtime.loader import read_model_config
from moe_runtime.memory_plan import plan_memory

PROMPTS = [[5, 17, 33, 2, 250, 7, 91, 12], [9, 1, 44]]
NEW = 16
RUNTIME = dict(max_model_len=64, max_batch_size=2)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """variant -> (checkpoint folder, transformers model, [(tokens, step logits [NEW, V])] per prompt)."""
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for i, variant in enumerate(DEEPSEEK_VARIANTS):
        path = make_deepseek_checkpoint(variant, root / variant, seed=i)
        out[variant] = (path, *greedy_references(path, PROMPTS, NEW))
    return out


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
@pytest.mark.parametrize("variant", list(DEEPSEEK_VARIANTS))
def test_greedy_tokens_and_logits_match_transformers(deepseek, variant, slots):
    path, _, refs = deepseek[variant]
    check_greedy_matches(path, refs, PROMPTS, slots, RUNTIME)


@pytest.mark.parametrize("variant", list(DEEPSEEK_VARIANTS))
def test_prefill_logits_match_forward(deepseek, variant):
    path, model, refs = deepseek[variant]
    check_prefill_matches(path, model, PROMPTS[0] + refs[0][0], RUNTIME)


def test_kv_cache_holds_the_latent(deepseek):
    """One [kv_lora_rank + qk_rope_head_dim] row per token and layer, not expanded K/V, in blocks
    of 16 tokens (the static layout's memory by default: 2 sequences of 64), and the memory plan
    counts exactly those bytes."""
    path = deepseek["v3"][0]
    runtime = RuntimeConfig(**RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        cfg, kv = engine.config, engine.kv
        assert isinstance(kv, PagedMLACache)
        width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        assert kv.latent.shape == (cfg.num_layers, 2 * 64 // 16, 16, 1, width)
        assert kv.nbytes == cfg.num_layers * 2 * 64 * width * 4 == plan_memory(cfg, runtime).kv_cache
        expanded = 2 * cfg.num_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) // 2
        assert width < expanded
        engine.generate([PROMPTS[1]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert kv.latent[:, 0, : len(PROMPTS[1]) + 1].abs().sum() > 0  # the first block taken


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_router_matches_transformers(deepseek, variant):
    """Our route() picks the same experts with the same weights as transformers' router module on
    256 tokens (group masking exercised far more than by the decode tests)."""
    path, model, _ = deepseek[variant]
    _, cfg, _ = read_model_config(path)
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, ref_w, ref_ids = gate(x)
    bias = getattr(gate, "e_score_correction_bias", None)
    weights, ids = route(x, gate.weight.detach(), cfg, bias)
    order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("variant", "change", "field"),
    [
        ("v2", {"n_group": 3}, "n_group=3"),
        ("v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("v3", {"topk_method": "group_limited_greedy"}, "topk_method"),
        ("v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ("v3", {"kv_lora_rank": "16"}, "kv_lora_rank"),
        (
            "v3",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
            "rope_parameters.rope_type",
        ),
        ("v2", {"topk_group": 9}, "topk_group"),
    ],
)
def test_bad_config_fields_are_named(deepseek, tmp_path, variant, change, field):
    src = deepseek[variant][0]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field):
        read_model_config(tmp_path)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
def test_rotary_equals_transformers(deepseek, interleave):
    """The YaRN cos/sin tables and both pair layouts equal transformers' DeepSeek-V3 RoPE bit for bit
    (same layout out: ``[evens | odds]`` for the interleaved form)."""
    path, model, _ = deepseek["v3"]
    _, cfg, _ = read_model_config(path)
    ours = LatentRotary(
        dataclasses.replace(cfg.mla, rope_interleave=interleave),
        cfg.rope_theta,
        64,
        torch.float32,
        torch.device("cpu"),
    )
    positions = torch.arange(0, 64, 3)
    q = torch.randn(1, 4, len(positions), 8, generator=torch.Generator().manual_seed(1))
    k = torch.randn(1, 1, len(positions), 8, generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(q, positions[None])
    apply = ref.apply_rotary_pos_emb_interleave if interleave else ref.apply_rotary_pos_emb
    want_q, want_k = apply(q, k, cos, sin)
    assert torch.equal(ours.apply(q[0].transpose(0, 1), positions), want_q[0].transpose(0, 1))
    assert torch.equal(ours.apply(k[0].transpose(0, 1), positions), want_k[0].transpose(0, 1))


V2_LITE = {  # DeepSeek-V2-Lite's config.json (the fields we read)
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "vocab_size": 102400,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}
V3 = {  # DeepSeek-V3/R1's config.json, bf16 (no quantization_config)
    **V2_LITE,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {**V2_LITE["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0},
    "vocab_size": 129280,
}


@pytest.mark.parametrize(
    ("raw", "moe_layers", "shared", "yarn_scale"),
    [(V2_LITE, range(1, 27), 2 * 1408, 0.707), (V3, range(3, 61), 2048, 1.0)],
    ids=["v2-lite", "v3"],
)
def test_released_configs_parse(tmp_path, raw, moe_layers, shared, yarn_scale):
    """The released checkpoints' own config format (``rope_scaling`` + ``rope_theta``) gives their
    shapes: MoE layers after the dense ones, the shared width, a 576-wide latent cache row, YaRN."""
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _, cfg, _ = read_model_config(tmp_path)
    assert cfg.moe_layers == list(moe_layers)
    assert cfg.shared_expert_intermediate_size == shared and not cfg.shared_expert_gate
    assert cfg.kv_elements_per_token == 576
    assert cfg.mla.yarn.factor == 40 and cfg.mla.yarn.mscale_all_dim == yarn_scale
    assert cfg.mla.yarn.original_max_position_embeddings == 4096
    v3 = raw is V3
    assert cfg.routing.topk_method == ("noaux_tc" if v3 else "greedy") and cfg.routing.score_bias == v3
    assert cfg.norm_topk_prob == v3 and cfg.mla.q_lora_rank == (1536 if v3 else 0)


def test_moe_layer_freq_makes_other_layers_dense(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**V2_LITE, "num_hidden_layers": 8, "moe_layer_freq": 2})
    )
    _, cfg, _ = read_model_config(tmp_path)
    assert cfg.moe_layers == [2, 4, 6]


def test_multi_token_prediction_layer_is_skipped(deepseek, tmp_path):
    """V3 checkpoints carry a multi-token-prediction layer after the last decoder layer
    (``model.layers.{num_hidden_layers}.*``); it is not served and does not fail the load."""
    from safetensors.torch import save_file

    path, _, refs = deepseek["v3"]
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    save_file(
        {
            "model.layers.3.eh_proj.weight": torch.ones(64, 128),
            "model.layers.3.mlp.experts.0.up_proj.weight": torch.ones(32, 64),
        },
        str(tmp_path / "mtp.safetensors"),
    )
    with LLMEngine.from_pretrained(tmp_path, RuntimeConfig(**RUNTIME)) as engine:
        out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == refs[0][0][:4]


def test_bf16_keeps_the_router_bias_fp32(deepseek):
    """In bf16 the V3 score bias stays fp32 (as in the checkpoint and transformers): the expert
    choice adds it to fp32 sigmoid scores, where a bf16-rounded bias would move the choice."""
    path = deepseek["v3"][0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(dtype="bf16", **RUNTIME)) as engine:
        w = engine.model.w
        assert (
            w["layers.1.router_bias"].dtype == torch.float32 and w["layers.1.router"].dtype == torch.bfloat16
        )
        out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4


def test_mixed_steps_and_chunked_prefill(deepseek):
    """A request joining while another decodes (a step mixing prefill and decode over the latent
    cache) and prompts prefilled in chunks of 3 tokens still give transformers' tokens."""
    path, _, refs = deepseek["v3"]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    runtime = RuntimeConfig(buffer_slots=3, max_num_batched_tokens=3, **RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        finals = join_mid_decode(engine, PROMPTS[0], PROMPTS[1], params)
    assert finals == {"a": refs[0][0], "b": refs[1][0]}
