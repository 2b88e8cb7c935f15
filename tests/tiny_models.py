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
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **FAMILY_KWARGS[family],
    )
    model = model_cls(cfg)
    with torch.no_grad():  # larger weights than the default init, so routing and tokens vary
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    if with_tokenizer:
        write_tokenizer(path)
    return path
