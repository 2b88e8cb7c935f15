"""Qwen3-MoE (``Qwen3MoeForCausalLM``): per-head q/k RMSNorm, no shared expert, fine-grained experts."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, routed_fields, sparse_layers
from moe_runtime.models.fields import ConfigFields


class Qwen3MoeFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        base = common_fields(f)
        return ModelConfig(
            family=self.name,
            **base,
            **routed_fields(f, "moe_intermediate_size"),
            norm_topk_prob=f.boolean("norm_topk_prob", False),
            dense_intermediate_size=f.size("dense_intermediate_size", "intermediate_size", default=0),
            qk_norm="head",
            attention_bias=f.boolean("attention_bias", False),
            moe_layers=sparse_layers(f, base["num_layers"]),
        )


FAMILY = Qwen3MoeFamily(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",))
