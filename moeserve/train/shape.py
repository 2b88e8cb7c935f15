"""Shape and training settings of the bundled tiny MoE, and its parameter split.

The shape follows the fine-grained MoEs MoE-Infinity targets (§3.1, Table 1: many small experts,
low per-token activation ratio): 64 experts of intermediate size 64 per layer, top-4 routing
(6.25 % of a layer's experts per token), every decoder layer sparse, Qwen3-MoE attention (GQA,
per-head q/k RMSNorm). Routed experts hold ~89 % of the parameters, as in the large models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TinyMoeShape:
    """Model shape (``Qwen3MoeConfig`` fields); sizes in elements."""

    vocab_size: int = 8192
    hidden_size: int = 128
    num_layers: int = 8
    num_experts: int = 64
    top_k: int = 4
    moe_intermediate_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Training-loop settings; ``batch_size`` rows of ``seq_len`` tokens, split evenly over domains."""

    steps: int = 900
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    eval_every: int = 100
    eval_windows: int = 16
    log_every: int = 10
    threads: int = 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_config(shape: TinyMoeShape, eos_token_id: int, aux_loss_coef: float):
    """The ``transformers.Qwen3MoeConfig`` of ``shape`` (all layers sparse, top-k renormalised)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.moe_intermediate_size
        * shape.top_k,  # dense MLP size; unused (no dense layer)
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        router_aux_loss_coef=aux_loss_coef,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def new_model(config, seed: int):
    """``Qwen3MoeForCausalLM`` at random init (seeded), float32, eager experts (fastest on CPU).

    NOTE: transformers 5 offers ``experts_implementation`` ``eager`` (a loop over hit experts),
    ``batched_mm`` and ``grouped_mm``. Measured on this 2-core CPU for a training step of 16x256
    tokens: eager ~2,400 tokens/s, grouped_mm ~500, batched_mm ~40 (it gathers every token's
    expert weights), so training and analysis use eager.
    """
    import torch
    from transformers import Qwen3MoeForCausalLM

    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def param_split(model) -> dict[str, int]:
    """Parameter counts by kind (tied embeddings counted once), in elements."""
    counts = {"experts": 0, "router": 0, "attention": 0, "embedding": 0, "lm_head": 0, "norms": 0}
    for name, p in model.named_parameters():  # tied parameters are yielded once
        if ".experts." in name:
            key = "experts"
        elif ".mlp.gate." in name:
            key = "router"
        elif "self_attn" in name and "norm" not in name:
            key = "attention"
        elif "embed_tokens" in name:
            key = "embedding"
        elif name.startswith("lm_head"):
            key = "lm_head"
        else:
            key = "norms"
        counts[key] += p.numel()
    counts["total"] = sum(counts.values())
    counts["active_per_token"] = (
        counts["total"]
        - counts["experts"]
        + counts["experts"] * model.config.num_experts_per_tok // model.config.num_experts
    )
    return counts


def format_split(counts: dict[str, int]) -> str:
    """One line per kind: count and share of the total."""
    total = counts["total"]
    return "\n".join(f"{k:>16}: {v:>11,} ({100 * v / total:5.1f} %)" for k, v in counts.items())
