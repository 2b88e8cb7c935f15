"""Phi-3.5-MoE (``phimoe``) against transformers' own PhimoeForCausalLM.

The tiny checkpoint (``tests/tiny_models.py`` ``PHIMOE``) has LongRoPE on (random short and long
factors, mscales 1.2 / 1.4, original context 64), a sparsemixer threshold of 0.3 (default 0.01),
and every bias random: q/k/v/o, the LayerNorms and the LM head. Greedy tokens equal and fp32
logits within 1e-4 at every step for 32 new tokens (all positions inside the original context),
for a batch of 4 prompts of different lengths, every expert resident and at a 2-slot buffer. Also:
the sparsemixer equals transformers' on many tokens, LongRoPE's tables equal transformers' per
forward call, the router lookahead folds the LayerNorm exactly, bad config fields are named.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_runtime_oracle import check_greedy_matches, check_prefill_matches, greedy_references
from tiny_models import make_phimoe_checkpoint
from transformers.models.phimoe import modeling_phimoe as ref

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.errors import ConfigError
from moe_runtime.layers.norm import layer_norm
from moe_runtime.layers.rotary import Rotary
from moe_runtime.layers.router_lookahead import RouterLookahead
from moe_runtime.layers.routing import route
from moe_runtime.loader import read_model_config

PROMPTS = [[5, 17, 33, 2, 250, 7, 91, 12], [9, 1, 44], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]
NEW = 32
RUNTIME = dict(max_model_len=64, max_batch_size=4)


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    """(checkpoint folder, transformers model, [(tokens, step logits [NEW, V])] per prompt)."""
    path = make_phimoe_checkpoint(tmp_path_factory.mktemp("phimoe") / "ckpt")
    return (path, *greedy_references(path, PROMPTS, NEW))


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
def test_greedy_tokens_and_logits_match_transformers(phi, slots):
    path, _, refs = phi
    check_greedy_matches(path, refs, PROMPTS, slots, RUNTIME)
    assert len({t for tokens, _ in refs for t in tokens}) > 8  # the outputs are not degenerate


def test_prefill_logits_match_forward(phi):
    path, model, refs = phi
    check_prefill_matches(path, model, PROMPTS[2] + refs[2][0], RUNTIME)  # 44 positions < 64


def test_sparsemixer_matches_transformers(phi):
    """Same experts (in the same order) and weights as transformers' router on 512 tokens; the
    0.3 threshold masks some logits out of the softmax, so the weights are not a plain softmax."""
    path, model, _ = phi
    _, cfg, _ = read_model_config(path)
    router = model.model.layers[1].mlp.router
    x = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, ref_w, ref_ids = router(x)
        weights, ids = route(x, router.weight, cfg)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=0)
    plain = F.softmax(x @ router.weight.detach().T, dim=-1).gather(1, ids[:, :1])
    assert (weights[:, :1] - plain).abs().max() > 1e-2


def test_longrope_tables_equal_transformers(phi):
    """Within the original context: transformers' cos/sin bit for bit (short factors, short
    mscale). Beyond it: transformers' rule for a call whose positions all lie beyond (a decode
    step), i.e. still the short factors, with the long mscale."""
    path, model, _ = phi
    _, cfg, _ = read_model_config(path)
    ours = Rotary(cfg.head_dim, cfg.rope_theta, 128, torch.float32, torch.device("cpu"), None, cfg.longrope)
    x = torch.zeros(1, dtype=torch.float32)
    inside = torch.arange(64)
    cos, sin = model.model.rotary_emb(x, inside[None])
    assert torch.equal(ours.cos[inside], cos[0]) and torch.equal(ours.sin[inside], sin[0])
    for pos in (64, 100, 127):  # one decode token at a time
        cos, sin = model.model.rotary_emb(x, torch.tensor([[pos]]))
        assert torch.equal(ours.cos[pos], cos[0, 0]) and torch.equal(ours.sin[pos], sin[0, 0])
    assert ours.cos[0, 0] == pytest.approx(1.2) and ours.cos[64, 0] != pytest.approx(1.2)
    q = torch.randn(1, 4, 3, 16)
    pos = torch.tensor([0, 5, 63])
    cos, sin = model.model.rotary_emb(x, pos[None])
    want, _ = ref.apply_rotary_pos_emb(q, q[:, :2], cos, sin)
    got, _ = ours.apply(q[0].transpose(0, 1), q[0, :2].transpose(0, 1), pos)
    assert torch.equal(got, want[0].transpose(0, 1))


def test_router_lookahead_folds_the_layernorm(phi):
    """The lookahead's logits of MoE layer 1 from a hidden state equal layer 1's router applied to
    its LayerNorm (weight and bias) of that state."""
    path = phi[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        cfg, w = engine.config, engine.model.w
        look = RouterLookahead(cfg, w, depth=1)
        x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(3)) * 3 + 1
        want = F.linear(
            layer_norm(x, w["layers.1.mlp_norm"], w["layers.1.mlp_norm_bias"], cfg.rms_norm_eps),
            w["layers.1.router"],
        )
        torch.testing.assert_close(look.logits(x, 0)[:, 0], want, atol=1e-5, rtol=0)


PHI_35_MOE = {  # microsoft/Phi-3.5-MoE-instruct config.json (the fields we read; factors shortened)
    "architectures": ["PhiMoEForCausalLM"],
    "model_type": "phimoe",
    "attention_bias": True,
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "input_jitter_noise": 0.01,
    "intermediate_size": 6400,
    "lm_head_bias": True,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "type": "longrope",
        "long_factor": [1.5] * 64,
        "short_factor": [1.0] * 64,
        "long_mscale": 1.243163121016122,
        "short_mscale": 1.243163121016122,
        "original_max_position_embeddings": 4096,
    },
    "rope_theta": 10000.0,
    "router_jitter_noise": 0.01,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 32064,
}


def test_released_config_parses(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PHI_35_MOE))
    family, cfg, _ = read_model_config(tmp_path)
    assert family.name == "phimoe"  # the hub spells it PhiMoEForCausalLM (remote code)
    assert cfg.moe_layers == list(range(32)) and cfg.head_dim == 128 and cfg.moe_intermediate_size == 6400
    assert cfg.longrope.original_max_position_embeddings == 4096 and len(cfg.longrope.short_factor) == 64
    assert cfg.routing.topk_method == "sparsemixer" and cfg.routing.jitter_eps == 0.01
    assert cfg.o_bias and cfg.lm_head_bias and cfg.norm == "layer" and cfg.eos_token_ids == [32000]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_experts_per_tok": 3}, "sparsemixer routing is top-2 only"),
        ({"sliding_window": 2048}, "sliding_window=2048"),
        ({"router_jitter_noise": "0.01"}, "router_jitter_noise"),
        (
            {"rope_scaling": {**PHI_35_MOE["rope_scaling"], "short_factor": [1.0] * 63}},
            "rope_scaling.short_factor",
        ),
        ({"rope_scaling": {**PHI_35_MOE["rope_scaling"], "long_mscale": None}}, "rope_scaling.long_mscale"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling.type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_config_fields_are_named(tmp_path, change, field):
    (tmp_path / "config.json").write_text(json.dumps({**PHI_35_MOE, **change}))
    with pytest.raises(ConfigError, match=field):
        read_model_config(tmp_path)


def test_memory_plan_counts_the_biases(phi):
    """LayerNorm, o_proj and LM-head biases are in the loaded dense weights and the memory plan."""
    from moe_runtime.memory_plan import plan_memory

    path = phi[0]
    _, cfg, _ = read_model_config(path)
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        dense = engine.model.w
    for name in ("final_norm_bias", "lm_head_bias", "layers.1.o_bias", "layers.0.attn_norm_bias"):
        assert dense[name].abs().sum() > 0
    assert plan_memory(cfg, RuntimeConfig(**RUNTIME)).dense == sum(t.numel() * 4 for t in dense.values())
