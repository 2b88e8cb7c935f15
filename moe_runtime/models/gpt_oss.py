"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): MXFP4 checkpoints as they ship, and
unquantized (bf16/fp32) ones.

What differs from the Llama-style families, and where it runs:

* attention: q/k/v/o projections with biases; a learned sink logit per head (``self_attn.sinks``)
  joining the softmax denominator; ``layer_types`` alternating ``sliding_attention`` (a query sees
  the last ``sliding_window`` positions) and ``full_attention`` layers
  (``moe_runtime.layers.attention``: sinks rescale SDPA's output by its log-sum-exp; a sliding
  layers' block group keeps only the KV blocks a window still covers, ``moe_runtime.layers.kv_cache``);
  YaRN RoPE in the half-split layout
  (``moe_runtime.layers.rotary``).
* router: ``mlp.router`` is a linear layer with a bias; top-k of its logits, then a softmax over
  those k (``moe_runtime.layers.routing``, ``topk_softmax``).
* experts: fused checkpoint tensors ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up
  interleaved along the last axis (gate ``[..., 0::2]``, up ``[..., 1::2]``) and
  ``down_proj [E, I, H]``, both ``in x out``: stored per expert in the host store's
  ``[gate | up | down]`` (``out x in``) layout. Their biases ``gate_up_proj_bias [E, 2I]``
  (interleaved, reordered to ``[gate | up]`` at load) and ``down_proj_bias [E, H]`` stay resident
  per MoE layer and are added by expert id (``moe_runtime.layers.experts.ExpertFFN``). The
  activation is the clamped SwiGLU :class:`~moe_runtime.config_types.ClampedSwiGLU`.

MXFP4 checkpoints (``quantization_config.quant_method: mxfp4``, as on the Hub) store the experts
as ``gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``gate_up_proj_scales [E, 2I, H/32]`` and
``down_proj_blocks [E, H, I/32, 16]`` / ``down_proj_scales [E, H, I/32]`` (uint8; ``out x in``,
the transpose of the unquantized tensors; transformers' ``integrations.mxfp4`` dequantizes them to
those) with gate and up interleaved along the ``2I`` rows; biases, attention, router, embeddings
and LM head unquantized (``modules_to_not_convert``). The loader pairs ``*_blocks`` with
``*_scales`` (:mod:`moe_runtime.quant.checkpoint`), the base names map as the unquantized
fused tensors do (``Family.classify``), and :meth:`GptOssFamily.fused_quantized_experts` takes
the even and odd rows of the packed bytes: the experts stay MXFP4 in host store, link and slots
(``--expert-dtype auto``), or are dequantized at load for another ``--expert-dtype``. Other
quantization methods are refused when the config is parsed.
"""

from __future__ import annotations

import torch

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import ClampedSwiGLU, Routing
from moe_runtime.errors import ConfigError
from moe_runtime.layers.routing import check_routing
from moe_runtime.models.base import ROPE_KEYS, Family, common_fields, yarn_of
from moe_runtime.models.fields import ConfigFields, show

#: checkpoint name after ``model.layers.{i}.`` -> canonical dense short name, beyond the Llama
#: names (``Family.layer_names``)
DENSE_NAMES = {
    "self_attn.sinks": "sinks",
    "mlp.router.weight": "router",
    "mlp.router.bias": "router_logit_bias",
    "mlp.experts.gate_up_proj_bias": "expert_gate_up_bias",
    "mlp.experts.down_proj_bias": "expert_down_bias",
}
LAYER_TYPES = ("sliding_attention", "full_attention")
_EXPERT_HF = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}


def sliding_layers_of(f: ConfigFields, num_layers: int) -> list[int]:
    """Indices of the ``sliding_attention`` layers in ``layer_types`` (default: every even layer,
    as transformers' ``GptOssConfig``).

    Raises:
        ConfigError: ``layer_types`` not a list of ``num_hidden_layers`` known layer types.
    """
    used, types = f.get("layer_types")
    if types is None:
        return list(range(0, num_layers, 2))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"{used} must be a list of {num_layers} entries (num_hidden_layers), each one of "
            f"{', '.join(LAYER_TYPES)}, got {show(types)}"
        )
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


class GptOssFamily(Family):
    def parse_config(self, f: ConfigFields) -> ModelConfig:
        quant = f.mapping("quantization_config")
        if quant and quant.get("quant_method") != "mxfp4":
            raise ConfigError(
                f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported "
                "for gpt-oss (supported: mxfp4, or an unquantized checkpoint)"
            )
        # RoPE is read by yarn_of (common_fields refuses scaling types it does not implement)
        base = common_fields(ConfigFields({k: v for k, v in f.raw.items() if k not in ROPE_KEYS}))
        layers = base["num_layers"]
        theta, yarn = yarn_of(f, base["max_position_embeddings"], default_theta=150000.0)
        base["rope_theta"] = theta
        experts = f.size("num_experts", "num_local_experts", "num_experts")
        top_k = f.size("top_k", "num_experts_per_tok", "experts_per_token")
        routing = Routing(scoring="softmax", topk_method="topk_softmax")
        check_routing(routing, experts, top_k)
        sliding = sliding_layers_of(f, layers)
        window = f.integer("sliding_window", lo=1, hi=1 << 24, default=128) if sliding else None
        bias = f.boolean("attention_bias", True)
        return ModelConfig(
            family=self.name,
            **base,
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=f.size("moe_intermediate_size", "intermediate_size"),
            norm_topk_prob=False,
            router_weights_in_model_dtype=True,
            attention_bias=bias,
            o_bias=bias,
            moe_layers=list(range(layers)),
            routing=routing,
            yarn=yarn,
            attention_sinks=True,
            sliding_window=window,
            sliding_layers=sliding,
            router_logit_bias=True,
            expert_bias=True,
            expert_act=ClampedSwiGLU(
                alpha=f.number("swiglu_alpha", default=1.702), limit=f.number("swiglu_limit", default=7.0)
            ),
        )

    def fused_experts(self, part: str, tensor: torch.Tensor, intermediate: int) -> dict[str, torch.Tensor]:
        """``gate_up_proj [E, H, 2I]`` (interleaved) -> gate/up ``[E, I, H]``; ``down_proj
        [E, I, H]`` -> ``[E, H, I]`` (transposed views)."""
        if part == "gate_up":
            return {"gate": tensor[..., 0::2].transpose(1, 2), "up": tensor[..., 1::2].transpose(1, 2)}
        return {"down": tensor.transpose(1, 2)}

    def fused_quantized_experts(
        self, part: str, parts: dict[str, torch.Tensor], intermediate: int
    ) -> dict[str, dict[str, torch.Tensor]]:
        """MXFP4 ``gate_up_proj_blocks [E, 2I, G, 16]`` / ``_scales [E, 2I, G]`` (gate even rows,
        up odd rows) -> gate/up ``[E, I, ...]`` per component, the packed bytes of whole rows
        (exact, nothing dequantized); ``down_proj_*`` ``[E, H, ...]`` as stored."""
        if part == "gate_up":
            return {
                "gate": {c: t[:, 0::2] for c, t in parts.items()},
                "up": {c: t[:, 1::2] for c, t in parts.items()},
            }
        return {"down": parts}

    def dense_tensor(self, canonical: str, tensor: torch.Tensor) -> torch.Tensor:
        """The interleaved ``gate_up_proj_bias [E, 2I]`` as ``[gate | up]``, the slots' row order."""
        if canonical.endswith(".expert_gate_up_bias"):
            return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        return tensor

    def expert_name(self, layer: int, expert: int, part: str) -> str:
        return f"model.layers.{layer}.mlp.experts.{_EXPERT_HF[part]} (expert {expert})"


FAMILY = GptOssFamily(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    layer_names=tuple(DENSE_NAMES.items()),
)
