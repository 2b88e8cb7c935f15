"""Tiny random checkpoints written with ``transformers`` (the oracle) for tests.

``make_checkpoint(family, path)`` writes a Hugging Face folder (config, safetensors, generation
config, and a small byte-level BPE tokenizer trained on a fixed text) for one of the four families.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"
    "The quick brown fox jumps over the lazy dog. To be, or not to be, that is the question.\n"
    "Question: What is the capital of France? Answer: Paris.\n"
    "A Mixture-of-Experts layer routes each token to its top-k experts; experts live in host memory.\n"
) * 20

#: config fields every tiny checkpoint shares
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    max_position_embeddings=256,
    eos_token_id=0,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)

FAMILY_KWARGS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        intermediate_size=64,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        intermediate_size=64,
        head_dim=16,
        norm_topk_prob=True,
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=48),
}


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def make_checkpoint(
    family: str, path: Path, seed: int = 0, num_layers: int = 2, with_tokenizer: bool = True
) -> Path:
    import transformers

    classes = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    cfg = config_cls(
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **COMMON,
        **FAMILY_KWARGS[family],
    )
    _save_random(model_cls(cfg), path)
    if with_tokenizer:
        write_tokenizer(path)
    return path


def _save_random(model, path: Path) -> None:
    """Save ``model`` with larger weights than the default init, so routing and tokens vary (and
    DeepSeek-V3's ``e_score_correction_bias`` is not all zeros)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)


_YARN = {"type": "yarn", "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

#: DeepSeek variants: V2 without q compression and group-limited routing; V2 with q compression,
#: greedy routing and V2-Lite's YaRN; V3 with noaux_tc, the score bias, renormalised and scaled
#: weights and YaRN with a softmax mscale.
DEEPSEEK_VARIANTS = {
    "v2": dict(
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    "v2_qlora_yarn": dict(
        q_lora_rank=32,
        topk_method="greedy",
        rope_scaling={**_YARN, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "v3": dict(
        q_lora_rank=32,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_scaling={**_YARN, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
}


def make_deepseek_checkpoint(variant: str, path: Path, seed: int = 0) -> Path:
    """A tiny DeepSeek checkpoint (3 layers, the first dense; 8 routed experts, top-2, 2 shared;
    MLA with kv_lora_rank 16, rope 8, nope 16, v 12) of one of :data:`DEEPSEEK_VARIANTS`."""
    import transformers

    v3 = variant.startswith("v3")
    config_cls = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    model_cls = transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    cfg = config_cls(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        **COMMON,
        **DEEPSEEK_VARIANTS[variant],
    )
    _save_random(model_cls(cfg), path)
    return path


def _randomise_vectors(model, seed: int) -> None:
    """Biases ``N(0, 0.1)`` and norm weights ``1 + N(0, 0.1)``, so no bias term is zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                noise = torch.randn(p.shape, generator=g) * 0.1
                p.copy_(noise + (1.0 if name.endswith("norm.weight") else 0.0))


#: GLM-4.5 tiny: grouped routing (4 groups of 2, 2 kept), 2 dense layers first, partial RoPE (a
#: quarter of the head), q/k/v biases, per-head q/k norm, score bias, scaled renormalised weights
GLM4_MOE = dict(
    num_hidden_layers=4,
    first_k_dense_replace=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.0,
    attention_bias=True,
    use_qk_norm=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def make_glm4_moe_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny GLM-4.5 checkpoint (:data:`GLM4_MOE`, fields overridable), random biases."""
    return _make_with_random_vectors("Glm4Moe", {**GLM4_MOE, **overrides}, path, seed)


def _make_with_random_vectors(prefix: str, fields: dict, path: Path, seed: int) -> Path:
    """``transformers.{prefix}ForCausalLM`` of :data:`COMMON` + ``fields``, random weights and
    :func:`_randomise_vectors`, saved to ``path``."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{prefix}Config")(**{**COMMON, **fields})
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    _randomise_vectors(model, seed)
    _save_random(model, path)
    return path


#: Phi-3.5-MoE tiny: LongRoPE (short/long factors and mscales, original context 64), a large
#: sparsemixer threshold, every bias (q/k/v/o, LayerNorms, LM head) random
PHIMOE = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    num_local_experts=8,
    num_experts_per_tok=2,
    router_jitter_noise=0.3,
    attention_bias=True,
    lm_head_bias=True,
    rms_norm_eps=1e-5,
)


def phimoe_rope(head_dim: int = 16, original: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": (1 + 3 * torch.rand(head_dim // 2, generator=g)).tolist(),
        "long_factor": (2 + 6 * torch.rand(head_dim // 2, generator=g)).tolist(),
        "short_mscale": 1.2,
        "long_mscale": 1.4,
        "original_max_position_embeddings": original,
    }


def make_phimoe_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Phi-3.5-MoE checkpoint (:data:`PHIMOE`, :func:`phimoe_rope`), random biases."""
    return _make_with_random_vectors(
        "Phimoe", {**PHIMOE, "rope_parameters": phimoe_rope(seed=seed), **overrides}, path, seed
    )


def make_gpt_oss_checkpoint(
    path: Path, seed: int = 0, sliding_window: int = 4, intermediate_size: int = 48
) -> Path:
    """A tiny gpt-oss checkpoint with non-default settings: 3 layers alternating sliding (window
    ``sliding_window``, shorter than the test prompts) and full attention, 6 experts, top-2, GQA
    (4 heads, 2 KV heads, head_dim 16), YaRN RoPE without truncation, random attention sinks,
    router and expert biases (transformers initialises the biases to zero), a tight SwiGLU clamp."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        num_hidden_layers=3,
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=intermediate_size,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
        **COMMON,
    )
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith(("sinks", "bias")):  # sinks [heads], router and expert biases
                p.normal_(0, 0.5 if name.endswith("sinks") else 0.1)
    model.save_pretrained(path)
    return path
