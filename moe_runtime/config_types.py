"""The plain value types a :class:`~moe_runtime.config.ModelConfig` holds for one model family's
specifics: YaRN and LongRoPE scaling, DeepSeek's latent-attention shape, a non-default router and
gpt-oss's expert activation.

They sit below the config so that the config imports nothing above it: the model families
(``moe_runtime.models``) fill them in from ``config.json``, and the layers that run them
(``moe_runtime.layers.yarn``, ``rotary``, ``mla``, ``routing``, ``experts``) import them from here.
This module imports nothing from the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """``rope_scaling``/``rope_parameters`` of ``type: yarn``.

    Attributes:
        factor: context extension factor (> 0).
        original_max_position_embeddings: pre-training context length.
        beta_fast / beta_slow: ramp ends, in rotations (defaults 32 / 1).
        mscale / mscale_all_dim: DeepSeek's magnitude scales (0 = unset).
        attention_factor: explicit cos/sin factor, or None to derive it from the above.
        truncate: round the correction range to whole dimensions (default true).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class LongRoPE:
    """``rope_scaling``/``rope_parameters`` of ``type: longrope`` (Phi-3.5-MoE).

    Attributes:
        short_factor / long_factor: per-frequency divisors, ``rotary_dim / 2`` each.
        short_mscale / long_mscale: cos/sin multipliers within / beyond the original context.
        original_max_position_embeddings: pre-training context length.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    short_mscale: float
    long_mscale: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class MLAShape:
    """MLA widths from ``config.json``.

    Attributes:
        q_lora_rank: query compression rank; 0 = a plain ``q_proj``.
        kv_lora_rank: width of the cached KV latent.
        qk_nope_head_dim / qk_rope_head_dim: per-head query/key widths without and with RoPE.
        v_head_dim: per-head value width.
        rope_interleave: rotary pairs are adjacent dims ``(x0, x1), (x2, x3)...`` (DeepSeek's
            layout; V2 always) rather than the two halves.
        yarn: YaRN scaling, or None for plain RoPE.
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    yarn: YarnScaling | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class Routing:
    """A DeepSeek-style router (also GLM-4.5's ``noaux_tc``), Phi-3.5-MoE's sparsemixer, or gpt-oss's
    ``topk_softmax``.

    Attributes:
        scoring: ``softmax`` (V2, gpt-oss) or ``sigmoid`` (V3).
        topk_method: ``greedy``, ``group_limited_greedy`` (V2), ``noaux_tc`` (V3: biased choice,
            groups ranked by their top-2 sum) or ``topk_softmax`` (gpt-oss: softmax over the
            top-k logits).
        n_group / topk_group: expert groups, and how many of them a token may use.
        routed_scaling_factor: multiplies the routed experts' gate weights (> 0).
        score_bias: the router carries ``e_score_correction_bias [E]`` (``noaux_tc`` only).
        jitter_eps: sparsemixer's relative mask threshold (``router_jitter_noise``, >= 0).

    :func:`moe_runtime.layers.routing.check_routing` checks it against the expert count.
    """

    scoring: str
    topk_method: str
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_bias: bool = False
    jitter_eps: float = 0.0


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: ``gate`` clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, then ``(up + 1) * (gate * sigmoid(gate * alpha))`` (transformers'
    ``GptOssExperts._apply_gate``, same op order, on our ``[gate | up]`` row layout).

    Attributes:
        alpha: sigmoid gain (``swiglu_alpha``, 1.702). limit: clamp (``swiglu_limit``, 7.0).
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [n, 2I]`` (overwritten) -> ``[n, I]``.

        The sigmoid runs in place on the ``up`` half (a view with row stride ``2I``): CPU kernels
        round a vectorised body and a scalar tail differently, and over a contiguous ``[n, I]``
        tensor where a row's elements fall depends on ``n``; over the view each row is its own
        loop, so the grouped, loop and few expert paths give the same bits (as ``F.silu`` on a
        ``chunk`` view does for the other families). Clamps, products and sums are exact."""
        i = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :i], gate_up[..., i:]
        gate.clamp_(max=self.limit)
        up_plus_one = up.clamp_(min=-self.limit, max=self.limit) + 1
        sig = torch.mul(gate, self.alpha, out=up).sigmoid_()
        return up_plus_one * (gate * sig)
