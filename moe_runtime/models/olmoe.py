"""OLMoE (``OlmoeForCausalLM``): q/k RMSNorm over the whole projection, optional ``clip_qkv``."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, routed_fields
from moe_runtime.models.fields import ConfigFields


class OlmoeFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        base = common_fields(f)
        return ModelConfig(
            family=self.name,
            **base,
            **routed_fields(f, "intermediate_size"),
            norm_topk_prob=f.boolean("norm_topk_prob", False),
            qk_norm="full",
            attention_bias=f.boolean("attention_bias", False),
            clip_qkv=f.number("clip_qkv", default=None),
            moe_layers=list(range(base["num_layers"])),
        )


FAMILY = OlmoeFamily(name="olmoe", architectures=("OlmoeForCausalLM",), model_types=("olmoe",))
