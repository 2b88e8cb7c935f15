"""Mixtral (``MixtralForCausalLM``): 8 experts, top-2, top-k weights always renormalised."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, routed_fields
from moe_runtime.models.fields import ConfigFields


class MixtralFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        base = common_fields(f)
        return ModelConfig(
            family=self.name,
            **base,
            **routed_fields(f, "intermediate_size"),
            norm_topk_prob=True,
            router_weights_in_model_dtype=False,
            moe_layers=list(range(base["num_layers"])),
        )


FAMILY = MixtralFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    moe_prefix="block_sparse_moe",
    expert_parts=(("w1", "gate"), ("w3", "up"), ("w2", "down")),
)
