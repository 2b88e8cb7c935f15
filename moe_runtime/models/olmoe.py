"""OLMoE (``OlmoeForCausalLM``): q/k RMSNorm over the whole projection, optional ``clip_qkv``."""

from moe_runtime.config import ModelConfig
from moe_runtime.models.base import Family, common_fields, require


class OlmoeFamily(Family):
    def parse_config(self, cfg: dict) -> ModelConfig:
        base = common_fields(cfg)
        clip = cfg.get("clip_qkv")
        return ModelConfig(
            family=self.name,
            **base,
            num_experts=int(require(cfg, "num_experts", "num_local_experts")),
            top_k=int(require(cfg, "num_experts_per_tok")),
            moe_intermediate_size=int(require(cfg, "intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            qk_norm="full",
            attention_bias=bool(cfg.get("attention_bias", False)),
            clip_qkv=float(clip) if clip is not None else None,
            moe_layers=list(range(base["num_layers"])),
        )


FAMILY = OlmoeFamily(name="olmoe", architectures=("OlmoeForCausalLM",), model_types=("olmoe",))
