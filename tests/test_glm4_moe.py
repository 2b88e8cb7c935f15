"""GLM-4.5 (``glm4_moe``) against transformers' own Glm4MoeForCausalLM.

The tiny checkpoint (``tests/tiny_models.py`` ``GLM4_MOE``) turns every non-default knob on: two
dense layers first, grouped routing (4 groups, 2 kept) with a random ``e_score_correction_bias``,
renormalised weights scaled by 2, partial RoPE over a quarter of each head, random q/k/v biases and
per-head q/k norms. Greedy tokens equal and fp32 logits within 1e-4 at every step for 32 new
tokens, for a batch of 4 prompts of different lengths, every expert resident and at a 2-slot
buffer; the router equals transformers' on many tokens; the released GLM-4.5-Air config parses to
its shapes; bad fields are refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_runtime_oracle import check_greedy_matches, check_prefill_matches, greedy_references
from tiny_models import make_glm4_moe_checkpoint
from transformers.models.glm4_moe import modeling_glm4_moe as ref

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.errors import ConfigError
from moe_runtime.layers.rotary import Rotary
from moe_runtime.layers.routing import route
from moe_runtime.loader import read_model_config
from moe_runtime.memory_plan import plan_memory

PROMPTS = [[5, 17, 33, 2, 250, 7, 91, 12], [9, 1, 44], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100]]
NEW = 32
RUNTIME = dict(max_model_len=64, max_batch_size=4)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint folder, transformers model, [(tokens, step logits [NEW, V])] per prompt)."""
    path = make_glm4_moe_checkpoint(tmp_path_factory.mktemp("glm4_moe") / "ckpt")
    return (path, *greedy_references(path, PROMPTS, NEW))


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
def test_greedy_tokens_and_logits_match_transformers(glm, slots):
    path, _, refs = glm
    check_greedy_matches(path, refs, PROMPTS, slots, RUNTIME)
    assert len({t for tokens, _ in refs for t in tokens}) > 8  # the outputs are not degenerate


def test_prefill_logits_match_forward(glm):
    path, model, refs = glm
    check_prefill_matches(path, model, PROMPTS[0] + refs[0][0], RUNTIME)


def test_router_matches_transformers(glm):
    """route() with the DeepSeek-V3 router picks transformers' experts and weights on 256 tokens;
    the group limit and the score bias both change the choice there."""
    path, model, _ = glm
    _, cfg, _ = read_model_config(path)
    gate = model.model.layers[2].mlp.gate
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, ref_w, ref_ids = gate(x)
    weights, ids = route(x, gate.weight.detach(), cfg, gate.e_score_correction_bias)
    order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0)
    plain = torch.topk(torch.sigmoid(x @ gate.weight.detach().T), 2, dim=-1).indices.sort(-1).values
    assert not torch.equal(plain, ids.sort(-1).values)


def test_partial_rotary_equals_transformers(glm):
    """Only the first quarter of each head turns, with transformers' cos/sin, bit for bit."""
    path, model, _ = glm
    _, cfg, _ = read_model_config(path)
    assert cfg.rotary_dim == 4 and cfg.moe_layers == [2, 3]
    ours = Rotary(cfg.head_dim, cfg.rope_theta, 64, torch.float32, torch.device("cpu"), cfg.rotary_dim)
    positions = torch.arange(0, 64, 3)
    q = torch.randn(1, 4, len(positions), 16, generator=torch.Generator().manual_seed(1))
    k = torch.randn(1, 2, len(positions), 16, generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(q, positions[None])
    want_q, want_k = ref.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ours.apply(q[0].transpose(0, 1), k[0].transpose(0, 1), positions)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., 4:], q[0].transpose(0, 1)[..., 4:])


def test_memory_plan_counts_dense_layers_and_biases(glm):
    path = glm[0]
    _, cfg, _ = read_model_config(path)
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        dense = engine.model.w
        for name in ("layers.0.mlp_gate", "layers.2.router_bias", "layers.2.shared_up", "layers.1.q_bias"):
            assert name in dense
        assert dense["layers.2.router_bias"].dtype == torch.float32
    assert plan_memory(cfg, RuntimeConfig(**RUNTIME)).dense == sum(t.numel() * 4 for t in dense.values())


GLM_45_AIR = {  # zai-org/GLM-4.5-Air config.json (the fields we read)
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": False,
    "vocab_size": 151552,
}


def test_released_config_parses(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM_45_AIR))
    _, cfg, _ = read_model_config(tmp_path)
    assert cfg.moe_layers == list(range(1, 46)) and cfg.rotary_dim == 64 and cfg.head_dim == 128
    assert cfg.shared_expert_intermediate_size == 1408 and not cfg.shared_expert_gate
    assert cfg.routing.topk_method == "noaux_tc" and cfg.routing.score_bias and cfg.norm_topk_prob
    assert cfg.rope_theta == 1e6 and cfg.qk_norm == "none" and cfg.attention_bias
    assert cfg.eos_token_ids == [151329, 151336, 151338]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n_group": 3}, "n_group=3"),
        ({"topk_group": 9}, "topk_group"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 0.01}, "partial_rotary_factor gives 1"),
        ({"first_k_dense_replace": 46}, "first_k_dense_replace"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling.type"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
    ],
)
def test_bad_config_fields_are_named(tmp_path, change, field):
    (tmp_path / "config.json").write_text(json.dumps({**GLM_45_AIR, **change}))
    with pytest.raises(ConfigError, match=field):
        read_model_config(tmp_path)


def test_multi_token_prediction_layer_is_skipped(glm, tmp_path):
    """GLM-4.5 checkpoints carry an MTP layer at ``model.layers.{num_hidden_layers}``; not served."""
    from safetensors.torch import save_file

    path, _, refs = glm
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    save_file({"model.layers.4.eh_proj.weight": torch.ones(64, 128)}, str(tmp_path / "mtp.safetensors"))
    with LLMEngine.from_pretrained(tmp_path, RuntimeConfig(**RUNTIME)) as engine:
        out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == refs[0][0][:4]
