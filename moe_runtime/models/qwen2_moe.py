"""Qwen2-MoE (``Qwen2MoeForCausalLM``): q/k/v bias, a shared expert scaled by a sigmoid gate."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, require, sparse_layers


class Qwen2MoeFamily(Family):
    def parse_config(self, cfg: dict) -> ModelConfig:
        base = common_fields(cfg)
        return ModelConfig(
            family=self.name,
            **base,
            num_experts=int(require(cfg, "num_experts", "num_local_experts")),
            top_k=int(require(cfg, "num_experts_per_tok")),
            moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
            attention_bias=bool(cfg.get("qkv_bias", True)),
            moe_layers=sparse_layers(cfg, base["num_layers"]),
        )


FAMILY = Qwen2MoeFamily(name="qwen2_moe", architectures=("Qwen2MoeForCausalLM",), model_types=("qwen2_moe",))
