"""Top-k routing variants behind one :func:`route`: router logits ``[T, E]`` -> the top-k experts of
each token and their gate weights.

* softmax top-k (Mixtral, Qwen, OLMoE; ``cfg.routing is None``): softmax over the experts, top-k,
  optionally renormalised;
* DeepSeek-V2 (``scoring="softmax"``): fp32 softmax scores, ``greedy`` top-k or
  ``group_limited_greedy`` (experts in ``n_group`` equal groups; only the ``topk_group`` groups
  with the highest best score compete);
* DeepSeek-V3 (``scoring="sigmoid"``, ``noaux_tc``): sigmoid scores; the
  ``e_score_correction_bias`` is added for the choice only (groups ranked by the sum of their top-2
  biased scores), the gate weights are the unbiased scores of the chosen experts;
* gpt-oss (``topk_softmax``): top-k of the router logits (a linear layer with a bias), then a
  softmax over those k logits only, in the logits' dtype (transformers' ``GptOssTopKRouter``).

* Phi-3.5-MoE's sparsemixer (``topk_method="sparsemixer"``, top-2 only), as transformers'
  ``sparsemixer`` computes it in eval mode: the top-1 expert is the largest logit, its weight the
  softmax over the logits within ``2 * jitter_eps`` (relative) of it; the top-2 expert is the
  largest other logit, its weight the softmax over the other logits within ``2 * jitter_eps`` of
  that one. Logits and weights stay in the model dtype.

The DeepSeek variants then renormalise (``norm_topk_prob``) and multiply by
``routed_scaling_factor``; their weights stay fp32, like transformers' ``DeepseekV{2,3}TopkRouter``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_runtime.config import ModelConfig
from moe_runtime.config_types import Routing
from moe_runtime.errors import ConfigError

SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "sparsemixer", "topk_softmax")


def check_routing(r: Routing, num_experts: int, top_k: int) -> None:
    """Check router ``r`` against the expert count and top-k.

    Raises:
        ConfigError: an unknown scoring or method, ``noaux_tc`` without sigmoid scores, or group
            counts that do not divide the experts / exceed the groups; the message names the
            ``config.json`` field.
    """
    if r.scoring not in SCORINGS:
        raise ConfigError(f"scoring_func must be one of {', '.join(SCORINGS)}, got {r.scoring!r}")
    if r.topk_method not in TOPK_METHODS:
        raise ConfigError(f"topk_method must be one of {', '.join(TOPK_METHODS)}, got {r.topk_method!r}")
    if (r.topk_method == "noaux_tc") != (r.scoring == "sigmoid"):
        raise ConfigError(f"topk_method {r.topk_method!r} does not go with {r.scoring} scores")
    if r.topk_method == "sparsemixer":
        if top_k != 2:
            raise ConfigError(f"num_experts_per_tok={top_k}: sparsemixer routing is top-2 only")
        if num_experts < 2 or not r.jitter_eps >= 0:
            raise ConfigError(
                f"sparsemixer needs >= 2 experts and router_jitter_noise >= 0, got {num_experts}, "
                f"{r.jitter_eps}"
            )
        return
    if r.topk_method == "topk_softmax" and r.scoring != "softmax":
        raise ConfigError(f"topk_method 'topk_softmax' does not go with {r.scoring} scores")
    if r.topk_method in ("greedy", "topk_softmax"):
        return
    if num_experts % r.n_group:
        raise ConfigError(f"n_group={r.n_group} does not divide n_routed_experts={num_experts}")
    if r.topk_group > r.n_group:
        raise ConfigError(f"topk_group={r.topk_group} exceeds n_group={r.n_group}")
    per_group = num_experts // r.n_group
    if r.topk_method == "noaux_tc" and per_group < 2:
        raise ConfigError(
            f"noaux_tc ranks groups by their top-2 experts; n_group={r.n_group} leaves {per_group}"
        )
    if top_k > r.topk_group * per_group:
        raise ConfigError(
            f"num_experts_per_tok={top_k} exceeds the {r.topk_group * per_group} experts "
            f"of topk_group={r.topk_group} groups"
        )


def route(
    x: torch.Tensor,
    router: torch.Tensor,
    cfg: ModelConfig,
    bias: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``x [T, H]`` with ``router [E, H]`` -> (gate weights ``[T, k]``, expert ids ``[T, k]``).

    ``bias [E]``: the ``e_score_correction_bias`` when ``cfg.routing.score_bias``.
    ``logit_bias [E]``: the router's linear bias when ``cfg.router_logit_bias`` (gpt-oss).
    """
    if cfg.routing is None:
        return _softmax_topk(x, router, cfg)
    if cfg.routing.topk_method == "sparsemixer":
        return _sparsemixer(F.linear(x, router), cfg.routing.jitter_eps)
    if cfg.routing.topk_method == "topk_softmax":
        top, ids = torch.topk(F.linear(x, router, logit_bias), cfg.top_k, dim=-1)  # [T, k] logits
        return F.softmax(top, dim=-1, dtype=top.dtype), ids
    return _grouped_topk(x, router, cfg, cfg.routing, bias)


def _softmax_topk(
    x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' softmax top-k: ``softmax(logits)`` in fp32, top-k, renormalised when
    ``norm_topk_prob``, cast to the model dtype when ``router_weights_in_model_dtype``.

    Renormalised, the top-k of the softmax over every expert divided by their sum is the softmax
    over the top-k logits alone (softmax is monotone, so the same experts win; the shared
    ``exp(-max) / Z`` cancels): that form is two ops (top-k, softmax; a bf16 or fp16 softmax
    computes in fp32 and rounds once, which is the fp32 softmax's cast) instead of five, and
    differs from the five-op one by rounding only (a few fp32 ulps of the weights)."""
    logits = F.linear(x, router)  # [T, E] in the model dtype
    f32 = torch.float32
    if cfg.norm_topk_prob:
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        if top.dtype == f32 or cfg.router_weights_in_model_dtype:
            # a low-precision softmax computes in fp32 and rounds once: the fp32 softmax cast
            return F.softmax(top, dim=-1), ids
        weights = F.softmax(top, dim=-1, dtype=f32)
    else:
        probs = F.softmax(logits, dim=-1) if logits.dtype == f32 else F.softmax(logits, dim=-1, dtype=f32)
        weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.router_weights_in_model_dtype and weights.dtype != x.dtype:
        weights = weights.to(x.dtype)
    return weights, ids


def _grouped_topk(
    x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig, r: Routing, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x.float(), router.float())  # [T, E], fp32 like the reference
    if r.scoring == "softmax":
        scores = logits.softmax(dim=-1)
        choice = scores
    else:
        scores = logits.sigmoid()
        choice = scores + bias.float() if bias is not None else scores
    if r.topk_method != "greedy":
        t, e = choice.shape
        grouped = choice.view(t, r.n_group, e // r.n_group)
        if r.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(-1, -1, e // r.n_group).reshape(t, e)
        # V2 zeroes the other groups' (positive) scores; V3 sets them to -inf
        choice = choice.masked_fill(~keep, float("-inf") if r.topk_method == "noaux_tc" else 0.0)
    ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.routed_scaling_factor, ids


def _sparsemixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's top-2 from router logits ``[T, E]`` (eval mode of transformers' ``sparsemixer``,
    step for step, so ties and masks resolve alike) -> (weights ``[T, 2]``, ids ``[T, 2]``)."""
    top1, ids1 = logits.max(dim=-1, keepdim=True)
    far = ((top1 - logits) / logits.abs().clamp(min=top1)) > 2 * jitter_eps
    w1 = logits.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, ids1)
    rest = torch.scatter(logits, -1, ids1, float("-inf"))
    top2, ids2 = rest.max(dim=-1, keepdim=True)
    far = ((top2 - logits) / logits.abs().clamp(min=top2)) > 2 * jitter_eps
    w2 = rest.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, ids2)
    return torch.cat((w1, w2), dim=-1), torch.cat((ids1, ids2), dim=-1)
