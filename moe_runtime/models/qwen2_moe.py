"""Qwen2-MoE (``Qwen2MoeForCausalLM``): q/k/v bias, a shared expert scaled by a sigmoid gate."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, routed_fields, sparse_layers
from moe_runtime.models.fields import ConfigFields


class Qwen2MoeFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        base = common_fields(f)
        return ModelConfig(
            family=self.name,
            **base,
            **routed_fields(f, "moe_intermediate_size"),
            norm_topk_prob=f.boolean("norm_topk_prob", False),
            shared_expert_intermediate_size=f.size(
                "shared_expert_intermediate_size", "shared_expert_intermediate_size", default=0
            ),
            dense_intermediate_size=f.size("dense_intermediate_size", "intermediate_size", default=0),
            attention_bias=f.boolean("qkv_bias", True),
            moe_layers=sparse_layers(f, base["num_layers"]),
        )


FAMILY = Qwen2MoeFamily(name="qwen2_moe", architectures=("Qwen2MoeForCausalLM",), model_types=("qwen2_moe",))
