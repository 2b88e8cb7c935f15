"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``): grouped-query attention with q/k/v biases,
optional per-head q/k RMSNorm (``use_qk_norm``), partial RoPE (the first ``partial_rotary_factor *
head_dim`` dims of each head, half-split ``rotate_half`` pairs like transformers'
``apply_rotary_pos_emb``; the rest pass through), the first ``first_k_dense_replace`` layers dense,
ungated shared experts (``n_shared_experts`` x ``moe_intermediate_size``, resident), and DeepSeek-V3's
router (``moe_runtime.layers.routing``, ``noaux_tc``): sigmoid scores, ``e_score_correction_bias``
for the choice, group-limited top-k (``n_group``/``topk_group``), ``norm_topk_prob`` and
``routed_scaling_factor``. The multi-token-prediction layer (``model.layers.{num_hidden_layers}``)
is not served.
"""

from __future__ import annotations

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import Routing
from moe_runtime.errors import ConfigError
from moe_runtime.layers.routing import check_routing
from moe_runtime.models.base import SHARED_EXPERTS_NAMES, Family, common_fields
from moe_runtime.models.fields import ConfigFields


def partial_rotary_dim(f: ConfigFields, head_dim: int) -> int:
    """Rotary dims ``int(head_dim * partial_rotary_factor)``, the factor read from
    ``rope_parameters`` (transformers>=5) or the top level (the checkpoints' format), default 0.5
    (transformers' default for GLM-4.5).

    Raises:
        ConfigError: a factor that is not a number in (0, 1] (or gives an odd width, checked by
            :class:`ModelConfig`).
    """
    params = ConfigFields(f.mapping("rope_parameters"), "rope_parameters.")
    source = params if params.raw.get("partial_rotary_factor") is not None else f
    factor = source.number("partial_rotary_factor", default=0.5)
    if factor > 1:
        used, _ = source.get("partial_rotary_factor")
        raise ConfigError(f"{used} must be in (0, 1], got {factor}")
    return int(head_dim * factor)


class Glm4MoeFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        base = common_fields(f)
        layers = base["num_layers"]
        experts = f.size("num_experts", "n_routed_experts", "num_local_experts")
        top_k = f.size("top_k", "num_experts_per_tok")
        routing = Routing(
            scoring="sigmoid",
            topk_method="noaux_tc",
            n_group=f.integer("n_group", lo=1, hi=experts, default=1),
            topk_group=f.integer("topk_group", lo=1, hi=experts, default=1),
            routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
            score_bias=True,
        )
        check_routing(routing, experts, top_k)
        width = f.size("moe_intermediate_size", "moe_intermediate_size")
        first_dense = f.integer("first_k_dense_replace", lo=0, hi=layers - 1, default=1)
        return ModelConfig(
            family=self.name,
            **base,
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=width,
            norm_topk_prob=f.boolean("norm_topk_prob", True),
            router_weights_in_model_dtype=False,
            shared_expert_intermediate_size=f.integer("n_shared_experts", lo=0, hi=1024, default=1) * width,
            shared_expert_gate=False,
            dense_intermediate_size=f.size("dense_intermediate_size", "intermediate_size", default=0),
            qk_norm="head" if f.boolean("use_qk_norm", False) else "none",
            attention_bias=f.boolean("attention_bias", False),
            moe_layers=list(range(first_dense, layers)),
            routing=routing,
            rotary_dim=partial_rotary_dim(f, base["head_dim"]),
        )


FAMILY = Glm4MoeFamily(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    fp32_weights=("router_bias",),
    layer_names=tuple(SHARED_EXPERTS_NAMES.items()),
    skips_layers_past_end=True,
)
