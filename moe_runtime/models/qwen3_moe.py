"""Qwen3-MoE (``Qwen3MoeForCausalLM``): per-head q/k RMSNorm, no shared expert, fine-grained experts."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, require, sparse_layers


class Qwen3MoeFamily(Family):
    def parse_config(self, cfg: dict) -> ModelConfig:
        base = common_fields(cfg)
        return ModelConfig(
            family=self.name,
            **base,
            num_experts=int(require(cfg, "num_experts", "num_local_experts")),
            top_k=int(require(cfg, "num_experts_per_tok")),
            moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
            qk_norm="head",
            attention_bias=bool(cfg.get("attention_bias", False)),
            moe_layers=sparse_layers(cfg, base["num_layers"]),
        )


FAMILY = Qwen3MoeFamily(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",))
