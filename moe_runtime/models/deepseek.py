"""DeepSeek-V2 (``DeepseekV2ForCausalLM``, V2/V2-Lite/V2.5) and DeepSeek-V3 (``DeepseekV3ForCausalLM``,
V3/R1): multi-head latent attention (``moe_runtime.layers.mla``), YaRN rope scaling, the first
``first_k_dense_replace`` layers dense, ungated shared experts (``n_shared_experts`` x
``moe_intermediate_size``, resident), group-limited top-k routing (``moe_runtime.layers.routing``).

The two differ in routing only: V2 ranks softmax scores (``greedy`` or ``group_limited_greedy``);
V3 ranks sigmoid scores plus ``e_score_correction_bias`` (``noaux_tc``) and renormalises
(``norm_topk_prob``). Both scale the gate weights by ``routed_scaling_factor``. As in
transformers' ``DeepseekV2TopkRouter``, V2 never renormalises (its checkpoints set
``norm_topk_prob: false``).
"""

from __future__ import annotations

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import MLAShape, Routing
from moe_runtime.errors import ConfigError
from moe_runtime.layers.routing import check_routing
from moe_runtime.models.base import ROPE_KEYS, SHARED_EXPERTS_NAMES, Family, common_fields, yarn_of
from moe_runtime.models.fields import ConfigFields

#: checkpoint name (after ``model.layers.{i}.``) -> canonical short name, beyond the Llama names
MLA_NAMES = {
    "self_attn.q_a_proj.weight": "q_a",
    "self_attn.q_a_proj.bias": "q_a_bias",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a",
    "self_attn.kv_a_proj_with_mqa.bias": "kv_a_bias",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b",
    **SHARED_EXPERTS_NAMES,
}


class DeepseekFamily(Family):
    """Both DeepSeek generations; ``self.name`` picks the router."""

    def parse_config(self, f: ConfigFields) -> ModelConfig:
        # RoPE is read by yarn_of (common_fields refuses scaling types it does not implement)
        base = common_fields(ConfigFields({k: v for k, v in f.raw.items() if k not in ROPE_KEYS}))
        layers, heads = base["num_layers"], base["num_heads"]
        theta, yarn = yarn_of(f, base["max_position_embeddings"])
        base["rope_theta"] = theta
        rope = f.integer("qk_rope_head_dim", lo=2, hi=1024)
        if rope % 2:
            raise ConfigError(f"qk_rope_head_dim={rope} must be even (RoPE rotates pairs)")
        mla = MLAShape(
            q_lora_rank=f.integer("q_lora_rank", lo=1, hi=1 << 16, default=0),
            kv_lora_rank=f.integer("kv_lora_rank", lo=1, hi=1 << 16),
            qk_nope_head_dim=f.integer("qk_nope_head_dim", lo=1, hi=1024),
            qk_rope_head_dim=rope,
            v_head_dim=f.integer("v_head_dim", lo=1, hi=1024),
            rope_interleave=True if self.name == "deepseek_v2" else f.boolean("rope_interleave", True),
            yarn=yarn,
        )
        experts = f.size("num_experts", "n_routed_experts", "num_local_experts")
        top_k = f.size("top_k", "num_experts_per_tok")
        v3 = self.name == "deepseek_v3"
        methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
        method = f.choice("topk_method", methods, methods[0])
        f.choice("scoring_func", ("sigmoid",) if v3 else ("softmax",), "")
        grouped = method != "greedy"
        routing = Routing(
            scoring="sigmoid" if v3 else "softmax",
            topk_method=method,
            n_group=f.integer("n_group", lo=1, hi=experts, default=1) if grouped else 1,
            topk_group=f.integer("topk_group", lo=1, hi=experts, default=1) if grouped else 1,
            routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
            score_bias=v3,
        )
        check_routing(routing, experts, top_k)
        first_dense = f.integer("first_k_dense_replace", lo=0, hi=layers - 1, default=0)
        freq = f.integer("moe_layer_freq", lo=1, hi=layers, default=1)
        width = f.size("moe_intermediate_size", "moe_intermediate_size")
        shared = f.integer("n_shared_experts", lo=0, hi=1024, default=0)
        attention_bias = f.boolean("attention_bias", False)
        if f.boolean("mlp_bias", False):
            raise ConfigError("mlp_bias: true is not supported (no DeepSeek checkpoint uses it)")
        return ModelConfig(
            family=self.name,
            **{**base, "num_kv_heads": heads, "head_dim": rope},
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=width,
            norm_topk_prob=v3 and f.boolean("norm_topk_prob", False),
            router_weights_in_model_dtype=False,
            shared_expert_intermediate_size=shared * width,
            shared_expert_gate=False,
            dense_intermediate_size=f.size("dense_intermediate_size", "intermediate_size", default=0),
            attention_bias=attention_bias,
            moe_layers=[i for i in range(first_dense, layers) if i % freq == 0],
            routing=routing,
            attention_kind="mla",
            mla=mla,
        )


DEEPSEEK_V2 = DeepseekFamily(
    name="deepseek_v2",
    architectures=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    layer_names=tuple(MLA_NAMES.items()),
    skips_layers_past_end=True,
)
DEEPSEEK_V3 = DeepseekFamily(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    fp32_weights=("router_bias",),
    layer_names=tuple(MLA_NAMES.items()),
    skips_layers_past_end=True,
)
