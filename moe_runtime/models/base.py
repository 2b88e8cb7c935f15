"""What a model family is: how its ``config.json`` maps onto :class:`ModelConfig` and how its
tensor names map onto our canonical weight names.

The supported families share the Llama-style dense naming (``model.layers.{i}.self_attn.
q_proj``...), so the mapping lives here and a family file only states what differs: where its MoE
block lives, what its expert matrices are called and how it reads its config (DeepSeek adds its
latent-attention and shared-expert names in ``deepseek.py``; their shapes are :func:`mla_shapes`).

Canonical names: ``embed``, ``final_norm`` (+ ``final_norm_bias``), ``lm_head`` (+ ``lm_head_bias``)
and, per decoder layer ``i``, ``layers.{i}.{attn_norm,mlp_norm,q,k,v,o,q_bias,k_bias,v_bias,o_bias,
q_norm,k_norm,router,router_bias,shared_gate_proj,shared_up,shared_down,shared_gate,mlp_gate,mlp_up,
mlp_down}`` (LayerNorm families add ``attn_norm_bias``, ``mlp_norm_bias``; gpt-oss adds ``sinks``,
``router_logit_bias``, ``expert_gate_up_bias``, ``expert_down_bias``). A family's own names
beyond these are its :attr:`Family.layer_names`.
Experts are addressed as ``(layer, expert, part)`` with part in ``gate``, ``up``, ``down``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import YarnScaling
from moe_runtime.models.fields import ConfigFields

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")  # fullmatch: "...weight\n" is not a weight

_DENSE_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "input_layernorm.bias": "attn_norm_bias",
    "post_attention_layernorm.bias": "mlp_norm_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "mlp_gate",
    "mlp.up_proj.weight": "mlp_up",
    "mlp.down_proj.weight": "mlp_down",
}

_TOP_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "model.norm.bias": "final_norm_bias",
    "lm_head.weight": "lm_head",
    "lm_head.bias": "lm_head_bias",
}
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")

#: DeepSeek-style MoE names (DeepSeek-V2/V3, GLM-4.5): ungated shared experts and the router's
#: ``e_score_correction_bias``; checkpoint name after ``model.layers.{i}.`` -> canonical short name
SHARED_EXPERTS_NAMES = {
    "mlp.gate.e_score_correction_bias": "router_bias",
    "mlp.shared_experts.gate_proj.weight": "shared_gate_proj",
    "mlp.shared_experts.up_proj.weight": "shared_up",
    "mlp.shared_experts.down_proj.weight": "shared_down",
}


@dataclass(frozen=True, slots=True)
class ExpertTensor:
    """One routed expert's matrix: ``expert`` is None for a fused ``[E, ...]`` tensor."""

    layer: int
    expert: int | None
    part: str  # gate | up | down | gate_up (fused only)


@dataclass(frozen=True)
class Family:
    """A model family: its names in ``config.json`` and in the checkpoint.

    Attributes:
        name: registry key, e.g. ``"mixtral"``.
        architectures: ``config.json`` ``architectures[0]`` values it serves.
        model_types: ``config.json`` ``model_type`` values it serves.
        moe_prefix: sub-module of a decoder layer holding router and experts.
        expert_parts: checkpoint name of each expert matrix -> ``gate``/``up``/``down``.
        fp32_weights: canonical short names of dense tensors kept in fp32 whatever the runtime
            dtype (DeepSeek-V3's ``router_bias``, fp32 in its checkpoints and in transformers).
        layer_names: the family's own per-layer names beyond the Llama ones: checkpoint name after
            ``model.layers.{i}.`` -> canonical short name (DeepSeek's latent attention).
        skips_layers_past_end: tensors of layers ``>= num_hidden_layers`` are known and not served
            (DeepSeek-V3's and GLM-4.5's multi-token-prediction layers, skipped by transformers too).
        quantized_suffixes: per ``quant_method``, the name suffix of each stored component of a
            quantized weight, as ``(method, ((component, suffix), ...))`` pairs (tuples keep the
            frozen family hashable), when the family's checkpoints differ from
            :data:`moe_runtime.quant.checkpoint.DEFAULT_SUFFIXES` (e.g.
            ``(("mxfp4", (("blocks", "_blocks"), ("scales", "_scales"))),)``); the name without
            the suffix is classified like an unquantized weight.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    moe_prefix: str = "mlp"
    expert_parts: tuple[tuple[str, str], ...] = (
        ("gate_proj", "gate"),
        ("up_proj", "up"),
        ("down_proj", "down"),
    )
    fp32_weights: tuple[str, ...] = ()
    layer_names: tuple[tuple[str, str], ...] = ()
    skips_layers_past_end: bool = False
    quantized_suffixes: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def parse_config(self, f: ConfigFields) -> ModelConfig:  # pragma: no cover - abstract
        """The :class:`ModelConfig` of a ``config.json``; raises ConfigError naming the field."""
        raise NotImplementedError

    def dense_dtype(self, canonical: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a dense tensor is kept in: ``dtype``, or fp32 for :attr:`fp32_weights`."""
        return torch.float32 if canonical.rsplit(".", 1)[-1] in self.fp32_weights else dtype

    def ignores(self, name: str, cfg: ModelConfig) -> bool:
        """A checkpoint tensor this family knows but does not serve: with
        :attr:`skips_layers_past_end`, layers past ``num_hidden_layers`` (V3's
        ``num_nextn_predict_layers``, ``model.layers.61.*``); none by default."""
        m = _LAYER_INDEX.match(name) if self.skips_layers_past_end else None
        return m is not None and int(m.group(1)) >= cfg.num_layers

    def fused_experts(self, part: str, tensor: torch.Tensor, intermediate: int) -> dict[str, torch.Tensor]:
        """A fused ``[E, ...]`` expert tensor (:meth:`classify` gave ``expert=None``) as stacks
        ``[E, out, in]`` per part: ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]`` (views).
        Default: transformers>=5's layout, ``gate_up [E, 2I, H]`` (gate rows first) and
        ``down [E, H, I]``; a wrong shape is caught when each expert is stored."""
        if part == "gate_up":
            return {"gate": tensor[:, :intermediate], "up": tensor[:, intermediate:]}
        return {"down": tensor}

    def suffixes_for(self, method: str) -> dict[str, str] | None:
        """Component -> name suffix of ``method``'s quantized weights in this family's
        checkpoints (:attr:`quantized_suffixes`), None for the defaults."""
        own = dict(self.quantized_suffixes).get(method)
        return dict(own) if own is not None else None

    def fused_quantized_experts(
        self, part: str, parts: dict[str, torch.Tensor], intermediate: int
    ) -> dict[str, dict[str, torch.Tensor]]:
        """A fused quantized expert tensor's components (``[E, out, ...]`` each, every output row
        with its own scales: MXFP4, int8) split per part along ``out`` into ``{part: {component:
        [E, out', ...]}}`` (views): rows are whole, so splitting them is exact and the experts stay
        quantized. Default: transformers>=5's row order, gate rows then up rows; a wrong shape is
        caught when each expert is stored."""
        if part == "gate_up":
            return {
                "gate": {c: t[:, :intermediate] for c, t in parts.items()},
                "up": {c: t[:, intermediate:] for c, t in parts.items()},
            }
        return {"down": parts}

    def dense_tensor(self, canonical: str, tensor: torch.Tensor) -> torch.Tensor:
        """A dense tensor as served, from the checkpoint's (shape-checked) tensor: unchanged by
        default (gpt-oss reorders its interleaved expert biases)."""
        return tensor

    def expert_name(self, layer: int, expert: int, part: str) -> str:
        """Checkpoint name of an expert matrix, for "missing tensor" messages."""
        hf = dict((v, k) for k, v in self.expert_parts)[part]
        return f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}.{hf}.weight"

    def hf_name(self, canonical: str) -> str:
        """Checkpoint name of a canonical dense tensor (the inverse of :meth:`classify`)."""
        top = {v: k for k, v in _TOP_NAMES.items()}
        if canonical in top:
            return top[canonical]
        _, layer, short = canonical.split(".", 2)
        own = {v: k for k, v in self.layer_names}
        if short in own:
            return f"model.layers.{layer}.{own[short]}"
        p = self.moe_prefix
        moe = {
            "router": f"{p}.gate.weight",
            "shared_gate": f"{p}.shared_expert_gate.weight",
            "shared_gate_proj": f"{p}.shared_expert.gate_proj.weight",
            "shared_up": f"{p}.shared_expert.up_proj.weight",
            "shared_down": f"{p}.shared_expert.down_proj.weight",
        }
        dense = {v: k for k, v in _DENSE_LAYER_NAMES.items()}
        return f"model.layers.{layer}.{moe.get(short) or dense[short]}"

    def classify(self, name: str) -> str | ExpertTensor | None:
        """Map a checkpoint tensor name to a canonical dense name or an :class:`ExpertTensor`.

        Returns None for tensors we do not use (e.g. rotary ``inv_freq`` buffers).
        """
        if name in _TOP_NAMES:
            return _TOP_NAMES[name]
        m = _LAYER.fullmatch(name)
        if m is None:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        own = dict(self.layer_names)
        if rest in own:
            return f"layers.{layer}.{own[rest]}"
        if rest in _DENSE_LAYER_NAMES:
            return f"layers.{layer}.{_DENSE_LAYER_NAMES[rest]}"
        p = self.moe_prefix
        if rest == f"{p}.gate.weight":
            return f"layers.{layer}.router"
        if rest == f"{p}.shared_expert_gate.weight":
            return f"layers.{layer}.shared_gate"
        for hf, ours in (
            ("gate_proj", "shared_gate_proj"),
            ("up_proj", "shared_up"),
            ("down_proj", "shared_down"),
        ):
            if rest == f"{p}.shared_expert.{hf}.weight":
                return f"layers.{layer}.{ours}"
        prefix = f"{p}.experts."
        if rest.startswith(prefix):
            tail = rest[len(prefix) :]
            if tail in ("gate_up_proj", "down_proj"):  # transformers>=5 fused in-memory layout
                return ExpertTensor(layer, None, "gate_up" if tail == "gate_up_proj" else "down")
            idx, _, part = tail.partition(".")
            part = part.removesuffix(".weight")
            mapping = dict(self.expert_parts)
            if idx.isascii() and idx.isdigit() and part in mapping:  # int("²") would raise
                return ExpertTensor(layer, int(idx), mapping[part])
        return None


def rope_theta_of(f: ConfigFields) -> float:
    """RoPE base from either the transformers<5 (``rope_theta``) or >=5 (``rope_parameters``) key.

    Raises:
        ConfigError: a non-object ``rope_parameters``/``rope_scaling``, a RoPE scaling type we do not
            implement, or a ``rope_theta`` that is not a finite number > 0.
    """
    params = ConfigFields(f.mapping("rope_parameters"), "rope_parameters.")
    scaling = ConfigFields(f.mapping("rope_scaling"), "rope_scaling.")
    for source, keys in ((params, ("rope_type",)), (scaling, ("rope_type", "type"))):
        for key in keys:
            source.choice(key, ("default",), "default")
    return params.number("rope_theta", default=None) or f.number("rope_theta", default=10000.0)


def yarn_of(
    f: ConfigFields, max_positions: int, default_theta: float = 10000.0
) -> tuple[float, YarnScaling | None]:
    """``(rope_theta, YaRN scaling or None)`` from ``rope_parameters`` (transformers>=5) or
    ``rope_scaling`` + ``rope_theta`` (the checkpoints' own format), as DeepSeek and gpt-oss
    write them; ``default_theta`` when neither gives ``rope_theta``.

    Raises:
        ConfigError: a rope type other than default/yarn, or a YaRN field mistyped/out of range.
    """
    params = f.mapping("rope_parameters")
    if params:
        source = ConfigFields(params, "rope_parameters.")
    else:
        source = ConfigFields(f.mapping("rope_scaling"), "rope_scaling.")
    theta = source.number("rope_theta", default=None) or f.number("rope_theta", default=default_theta)
    kinds = ("default", "yarn")
    kind = source.choice("rope_type", kinds, "") or source.choice("type", kinds, "default")
    if kind == "default":
        return theta, None
    original = source.integer("original_max_position_embeddings", lo=1, hi=1 << 24, default=max_positions)
    return theta, YarnScaling(
        factor=source.number("factor", default=max_positions / original),
        original_max_position_embeddings=original,
        beta_fast=source.number("beta_fast", default=32.0),
        beta_slow=source.number("beta_slow", default=1.0),
        mscale=source.number("mscale", default=0.0, positive=False),
        mscale_all_dim=source.number("mscale_all_dim", default=0.0, positive=False),
        attention_factor=source.number("attention_factor", default=None),
        truncate=source.boolean("truncate", True),
    )


#: config keys :func:`yarn_of` reads (a family using it hides them from :func:`common_fields`)
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def eos_ids_of(f: ConfigFields, vocab_size: int) -> list[int]:
    """``eos_token_id`` (an id or a list); ids outside the vocabulary are ignored (never sampled)."""
    return [i for i in f.int_list("eos_token_id", 0, 2**63 - 1, single=True) if i < vocab_size]


def common_fields(f: ConfigFields) -> dict[str, Any]:
    """Fields every family reads the same way, each type- and range-checked.

    Raises:
        ConfigError: naming the first field that is missing, mistyped or out of range.
    """
    f.choice("hidden_act", ("silu",), "silu")
    hidden = f.size("hidden_size", "hidden_size")
    heads = f.size("num_heads", "num_attention_heads")
    vocab = f.size("vocab_size", "vocab_size")
    bos = f.integer("bos_token_id", lo=-(2**63), hi=2**63 - 1, default=None)  # unused: kept when in vocab
    return dict(
        architecture=(f.raw.get("architectures") or [f.raw.get("model_type", "?")])[0],
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=f.size("num_layers", "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=f.size("num_kv_heads", "num_key_value_heads", default=heads),
        head_dim=f.size("head_dim", "head_dim", default=hidden // heads),
        rope_theta=rope_theta_of(f),
        rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
        max_position_embeddings=f.size("max_position_embeddings", "max_position_embeddings", default=4096),
        tie_word_embeddings=f.boolean("tie_word_embeddings", False),
        bos_token_id=bos if bos is not None and 0 <= bos < vocab else None,
        eos_token_ids=eos_ids_of(f, vocab),
    )


def routed_fields(f: ConfigFields, width_key: str) -> dict[str, Any]:
    """Routed-expert fields: E (``num_experts`` or ``num_local_experts``), top-k and the expert
    width read from ``width_key``."""
    return dict(
        num_experts=f.size("num_experts", "num_experts", "num_local_experts"),
        top_k=f.size("top_k", "num_experts_per_tok"),
        moe_intermediate_size=f.size("moe_intermediate_size", width_key),
    )


def sparse_layers(f: ConfigFields, num_layers: int) -> list[int]:
    """Qwen-style MoE layer selection: ``decoder_sparse_step`` and ``mlp_only_layers``."""
    step = f.integer("decoder_sparse_step", lo=1, hi=num_layers, default=1)
    dense = set(f.int_list("mlp_only_layers", 0, num_layers - 1))
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def expected_dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical dense tensor name -> shape, for the checkpoint's config."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "final_norm": (h,)}
    layer_norm = cfg.norm == "layer"  # LayerNorms carry a bias
    if layer_norm:
        shapes["final_norm_bias"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    if cfg.lm_head_bias:
        shapes["lm_head_bias"] = (cfg.vocab_size,)
    moe = set(cfg.moe_layers)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (h,), p + "mlp_norm": (h,)})
        if layer_norm:
            shapes.update({p + "attn_norm_bias": (h,), p + "mlp_norm_bias": (h,)})
        if cfg.mla is not None:
            shapes.update(mla_shapes(cfg, p))
        else:
            shapes.update(
                {p + "q": (q_out, h), p + "k": (kv_out, h), p + "v": (kv_out, h), p + "o": (h, q_out)}
            )
        if cfg.attention_bias and cfg.mla is None:
            shapes.update({p + "q_bias": (q_out,), p + "k_bias": (kv_out,), p + "v_bias": (kv_out,)})
        if cfg.o_bias and cfg.mla is None:
            shapes[p + "o_bias"] = (h,)
        if cfg.qk_norm == "head":
            shapes.update({p + "q_norm": (d,), p + "k_norm": (d,)})
        elif cfg.qk_norm == "full":
            shapes.update({p + "q_norm": (q_out,), p + "k_norm": (kv_out,)})
        if cfg.attention_sinks:
            shapes[p + "sinks"] = (cfg.num_heads,)
        if i in moe:
            shapes[p + "router"] = (cfg.num_experts, h)
            if cfg.routing is not None and cfg.routing.score_bias:
                shapes[p + "router_bias"] = (cfg.num_experts,)
            if cfg.router_logit_bias:
                shapes[p + "router_logit_bias"] = (cfg.num_experts,)
            if cfg.expert_bias:
                shapes[p + "expert_gate_up_bias"] = (cfg.num_experts, 2 * cfg.moe_intermediate_size)
                shapes[p + "expert_down_bias"] = (cfg.num_experts, h)
            si = cfg.shared_expert_intermediate_size
            if si:
                shapes.update(
                    {p + "shared_gate_proj": (si, h), p + "shared_up": (si, h), p + "shared_down": (h, si)}
                )
                if cfg.shared_expert_gate:
                    shapes[p + "shared_gate"] = (1, h)
        else:
            di = cfg.dense_intermediate_size
            shapes.update({p + "mlp_gate": (di, h), p + "mlp_up": (di, h), p + "mlp_down": (h, di)})
    return shapes


def mla_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention tensors of one layer (prefix ``p``): ``q`` or ``q_a``/``q_a_norm``/
    ``q_b``, ``kv_a``, ``kv_a_norm``, ``kv_b``, ``o`` (+ ``q_a_bias``, ``kv_a_bias``, ``o_bias``)."""
    s, h, n = cfg.mla, cfg.hidden_size, cfg.num_heads
    assert s is not None
    shapes: dict[str, tuple[int, ...]] = {
        p + "kv_a": (s.kv_lora_rank + s.qk_rope_head_dim, h),
        p + "kv_a_norm": (s.kv_lora_rank,),
        p + "kv_b": (n * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
        p + "o": (h, n * s.v_head_dim),
    }
    if s.q_lora_rank:
        shapes.update(
            {
                p + "q_a": (s.q_lora_rank, h),
                p + "q_a_norm": (s.q_lora_rank,),
                p + "q_b": (n * s.qk_head_dim, s.q_lora_rank),
            }
        )
    else:
        shapes[p + "q"] = (n * s.qk_head_dim, h)
    if cfg.attention_bias:
        shapes.update({p + "kv_a_bias": (s.kv_lora_rank + s.qk_rope_head_dim,), p + "o_bias": (h,)})
        if s.q_lora_rank:
            shapes[p + "q_a_bias"] = (s.q_lora_rank,)
    return shapes
