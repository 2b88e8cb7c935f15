"""What a model family is: how its ``config.json`` maps onto :class:`ModelConfig` and how its
tensor names map onto our canonical weight names.

All four supported families share the Llama-style dense naming (``model.layers.{i}.self_attn.
q_proj``...), so the mapping lives here and a family file only states what differs: where its MoE
block lives, what its expert matrices are called and how it reads its config.

Canonical names: ``embed``, ``final_norm``, ``lm_head`` and, per decoder layer ``i``,
``layers.{i}.{attn_norm,mlp_norm,q,k,v,o,q_bias,k_bias,v_bias,q_norm,k_norm,router,
shared_gate_proj,shared_up,shared_down,shared_gate,mlp_gate,mlp_up,mlp_down}``.
Experts are addressed as ``(layer, expert, part)`` with part in ``gate``, ``up``, ``down``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from moe_runtime.config import ModelConfig
from moe_runtime.errors import ConfigError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

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
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "mlp_gate",
    "mlp.up_proj.weight": "mlp_up",
    "mlp.down_proj.weight": "mlp_down",
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

    def parse_config(self, cfg: dict[str, Any]) -> ModelConfig:  # pragma: no cover - abstract
        raise NotImplementedError

    def hf_name(self, canonical: str) -> str:
        """Checkpoint name of a canonical dense tensor (the inverse of :meth:`classify`)."""
        top = {
            "embed": "model.embed_tokens.weight",
            "final_norm": "model.norm.weight",
            "lm_head": "lm_head.weight",
        }
        if canonical in top:
            return top[canonical]
        _, layer, short = canonical.split(".", 2)
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
        if name == "model.embed_tokens.weight":
            return "embed"
        if name == "model.norm.weight":
            return "final_norm"
        if name == "lm_head.weight":
            return "lm_head"
        m = _LAYER.match(name)
        if m is None:
            return None
        layer, rest = int(m.group(1)), m.group(2)
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
            if idx.isdigit() and part in mapping:
                return ExpertTensor(layer, int(idx), mapping[part])
        return None


def rope_theta_of(cfg: dict[str, Any]) -> float:
    """RoPE base from either the transformers<5 (``rope_theta``) or >=5 (``rope_parameters``) key.

    Raises:
        ConfigError: for RoPE scaling types we do not implement.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"config.json: rope type {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def eos_ids_of(cfg: dict[str, Any]) -> list[int]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if 0 <= int(i) < int(cfg.get("vocab_size", 0))]


def require(cfg: dict[str, Any], key: str, *aliases: str) -> Any:
    """``cfg[key]`` (or the first alias present); ConfigError naming ``key`` when none is."""
    for k in (key, *aliases):
        if cfg.get(k) is not None:
            return cfg[k]
    raise ConfigError(f"config.json: required field {key!r} is missing")


def common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fields every family reads the same way."""
    hidden = int(require(cfg, "hidden_size"))
    heads = int(require(cfg, "num_attention_heads"))
    bos = cfg.get("bos_token_id")
    return dict(
        architecture=(cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        vocab_size=int(require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=rope_theta_of(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=eos_ids_of(cfg),
    )


def sparse_layers(cfg: dict[str, Any], num_layers: int) -> list[int]:
    """Qwen-style MoE layer selection: ``decoder_sparse_step`` and ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
