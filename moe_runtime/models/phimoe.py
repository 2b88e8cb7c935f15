"""Phi-3.5-MoE (``PhimoeForCausalLM``): LayerNorm with a bias for the decoder and final norms
(``rms_norm_eps`` is its epsilon), q/k/v and o biases (``attention_bias``), an LM head bias
(``lm_head_bias``), 16 experts in Mixtral's layout (``block_sparse_moe.experts.{e}.w1/w3/w2``) routed
by the sparsemixer top-2 (``moe_runtime.layers.routing``; ``router_jitter_noise`` is its mask
threshold), and LongRoPE (``moe_runtime.layers.rotary``: equal to transformers within
``original_max_position_embeddings``; what differs beyond it is documented there).

``input_jitter_noise`` is a training-time input perturbation and is ignored; a ``sliding_window``
shorter than the context is refused (the attention here is full-context).
"""

from __future__ import annotations

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import LongRoPE, Routing
from moe_runtime.errors import ConfigError
from moe_runtime.layers.routing import check_routing
from moe_runtime.models.base import ROPE_KEYS, Family, common_fields
from moe_runtime.models.fields import ConfigFields, show


def _factors(source: ConfigFields, key: str, width: int) -> tuple[float, ...]:
    used, value = source.get(key)
    ok = isinstance(value, list) and len(value) == width
    if not ok or not all(not isinstance(v, bool) and isinstance(v, int | float) and v > 0 for v in value):
        raise ConfigError(f"{used} must be a list of {width} numbers > 0, got {show(value)}")
    return tuple(float(v) for v in value)


def longrope_of(f: ConfigFields, head_dim: int, max_positions: int) -> tuple[float, LongRoPE | None]:
    """``(rope_theta, LongRoPE or None)`` from ``rope_parameters`` (transformers>=5) or
    ``rope_scaling`` + ``rope_theta`` (the checkpoint's own format).

    Raises:
        ConfigError: a rope type other than default/longrope, factor lists not ``head_dim / 2``
            positive numbers, a missing or non-positive mscale.
    """
    params = f.mapping("rope_parameters")
    source = (
        ConfigFields(params, "rope_parameters.")
        if params
        else ConfigFields(f.mapping("rope_scaling"), "rope_scaling.")
    )
    theta = source.number("rope_theta", default=None) or f.number("rope_theta", default=10000.0)
    kinds = ("default", "longrope")
    kind = source.choice("rope_type", kinds, "") or source.choice("type", kinds, "default")
    if kind == "default":
        return theta, None
    original = source.integer(
        "original_max_position_embeddings",
        lo=1,
        hi=max_positions,
        default=f.integer("original_max_position_embeddings", lo=1, hi=max_positions, default=max_positions),
    )
    return theta, LongRoPE(
        short_factor=_factors(source, "short_factor", head_dim // 2),
        long_factor=_factors(source, "long_factor", head_dim // 2),
        short_mscale=source.number("short_mscale"),
        long_mscale=source.number("long_mscale"),
        original_max_position_embeddings=original,
    )


class PhimoeFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        # RoPE is read by longrope_of (common_fields refuses scaling types it does not implement)
        base = common_fields(ConfigFields({k: v for k, v in f.raw.items() if k not in ROPE_KEYS}))
        theta, longrope = longrope_of(f, base["head_dim"], base["max_position_embeddings"])
        window = f.integer("sliding_window", lo=1, hi=1 << 24, default=None)
        if window is not None and window < base["max_position_embeddings"]:
            raise ConfigError(
                f"sliding_window={window} is shorter than max_position_embeddings="
                f"{base['max_position_embeddings']}: sliding-window attention is not supported for phimoe"
            )
        experts = f.size("num_experts", "num_local_experts")
        top_k = f.size("top_k", "num_experts_per_tok")
        routing = Routing(
            scoring="softmax",
            topk_method="sparsemixer",
            jitter_eps=f.number("router_jitter_noise", default=0.01, positive=False),
        )
        check_routing(routing, experts, top_k)
        attention_bias = f.boolean("attention_bias", False)
        return ModelConfig(
            family=self.name,
            **{**base, "rope_theta": theta},
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=f.size("moe_intermediate_size", "intermediate_size"),
            norm_topk_prob=False,
            moe_layers=list(range(base["num_layers"])),
            attention_bias=attention_bias,
            o_bias=attention_bias,
            lm_head_bias=f.boolean("lm_head_bias", False),
            routing=routing,
            norm="layer",
            longrope=longrope,
        )


FAMILY = PhimoeFamily(
    name="phimoe",
    architectures=("PhimoeForCausalLM", "PhiMoEForCausalLM"),  # transformers; the hub's remote code
    model_types=("phimoe",),
    moe_prefix="block_sparse_moe",
    expert_parts=(("w1", "gate"), ("w3", "up"), ("w2", "down")),
)
