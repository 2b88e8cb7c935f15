"""Per-layer shapes of real MoE models, as published in their ``config.json`` files.

Every :class:`RealShape` carries the values of one model's ``config.json`` on the Hugging Face Hub
(cited in ``source``); :func:`hf_config` turns one into a ``transformers`` config of that family with
``layers`` decoder layers. Special tokens are not the real ones: a made checkpoint ships the
bundled model's byte-level BPE (padded to ``vocab_size``), whose EOS and padding id is 0.

Family-specific fields (DeepSeek's latent-attention ranks and grouped routing, dense-first layers,
GLM-4.5's partial RoPE, gpt-oss' sliding window, Phi-3.5-MoE's LongRoPE) live in a shape's
``extra``: ``config.json`` fields handed to the ``transformers`` config as they are.

Where the simulator already has a profile of the same model (:mod:`moeserve.sim.models`), the
shared numbers must agree; ``tests/test_make_checkpoint.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_runtime.dummy_weights import INITIALIZER_RANGE  # std of every weight matrix but the routers
from moe_runtime.errors import ConfigError

EOS_ID = 0  # <|endoftext|> of the bundled tokenizer (moeserve/train/tokenizer.py)
#: ``extra`` widths that ``shrunk`` divides along with the shape's own widths
EXTRA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, slots=True)
class RealShape:
    """One model's transformer shape.

    Attributes:
        model_type: ``transformers`` family (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
            ``deepseek_v2``, ``deepseek_v3``, ``glm4_moe``, ``gpt_oss``, ``phimoe``).
        num_layers: decoder layers of the real model (a made checkpoint keeps ``--layers`` of them).
        hidden, heads, kv_heads, head_dim, vocab: attention and embedding shape.
        experts, top_k, moe_intermediate: routed experts per layer, experts per token, expert width.
        dense_intermediate: the config's ``intermediate_size`` where it is not the expert width
            (Qwen families, DeepSeek, GLM-4.5: dense-MLP width; 0 = the family has none).
        shared_intermediate: width of the always-on shared expert(s) (Qwen2-MoE; DeepSeek and
            GLM-4.5: ``n_shared_experts x moe_intermediate``; 0 = none).
        qk_norm: ``none``, ``head`` (RMSNorm per head, Qwen3) or ``full`` (over all heads, OLMoE).
        attention_bias: q/k/v projections carry a bias (Qwen2-MoE).
        norm_topk_prob: top-k weights renormalised to sum to 1.
        rope_theta, rms_norm_eps, max_position_embeddings: as in the config.
        sim_profile: the simulator profile of the same model, if any.
        extra: further ``config.json`` fields of the family, passed to ``transformers`` as they
            are (``layer_types`` is a pattern repeated over the kept layers).
    """

    name: str
    model_type: str
    source: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    moe_intermediate: int
    dense_intermediate: int
    shared_intermediate: int
    qk_norm: str
    attention_bias: bool
    norm_topk_prob: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    sim_profile: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def first_dense(self) -> int:
        """Leading decoder layers with a dense MLP instead of experts (``first_k_dense_replace``)."""
        return int(self.extra.get("first_k_dense_replace", 0))

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down: ``3 * H * I``)."""
        return 3 * self.hidden * self.moe_intermediate

    def expert_bytes(self, dtype_bytes: int) -> int:
        return self.expert_params * dtype_bytes

    @property
    def attention_params(self) -> int:
        """Parameters of one decoder layer's attention: GQA projections (+ q/k/v bias, an output
        bias for gpt-oss and Phi-3.5-MoE, qk-norm, gpt-oss' sinks [heads]) or DeepSeek's latent
        attention (``q_a``/``q_a_norm``/``q_b`` or ``q``, ``kv_a``, ``kv_a_norm``, ``kv_b``, ``o``)."""
        h, x = self.hidden, self.extra
        if "kv_lora_rank" in x:  # multi-head latent attention (DeepSeek-V2/V3)
            qk = self.heads * (x["qk_nope_head_dim"] + x["qk_rope_head_dim"])
            qr, kvr, v = x["q_lora_rank"], x["kv_lora_rank"], self.heads * x["v_head_dim"]
            q = qr * (h + 1 + qk) if qr else h * qk  # q_a, q_a_norm, q_b, or one q
            kv_b = kvr * self.heads * x["qk_nope_head_dim"] + kvr * v
            return q + h * (kvr + x["qk_rope_head_dim"]) + kvr + kv_b + v * h  # ... kv_a, norm, kv_b, o
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * (2 * q + 2 * kv) + (q + 2 * kv if self.attention_bias else 0)
        attn += h if self.attention_bias and self.model_type in ("gpt_oss", "phimoe") else 0  # o bias
        attn += self.heads if self.model_type == "gpt_oss" else 0  # sinks
        return attn + {"none": 0, "head": 2 * self.head_dim, "full": q + kv}[self.qk_norm]

    @property
    def norm_params(self) -> int:
        """Parameters of one ``hidden``-wide norm: RMSNorm weight, or LayerNorm weight and bias (Phi)."""
        return 2 * self.hidden if self.model_type == "phimoe" else self.hidden

    @property
    def moe_params(self) -> int:
        """Parameters of one MoE block: router (+ gpt-oss' logit bias or the ``noaux_tc`` score
        bias, ``[E]``), routed experts (+ gpt-oss' expert biases ``[E, 2I + H]``), shared
        expert(s) (+ Qwen2-MoE's shared-expert gate)."""
        h, e = self.hidden, self.experts
        router = e * h + (e if self.model_type in ("gpt_oss", "deepseek_v3", "glm4_moe") else 0)
        experts = e * self.expert_params
        experts += e * (2 * self.moe_intermediate + h) if self.model_type == "gpt_oss" else 0
        shared = 3 * h * self.shared_intermediate if self.shared_intermediate else 0
        shared += h if self.shared_intermediate and self.model_type == "qwen2_moe" else 0  # its gate
        return router + experts + shared

    def layer_params(self, layer: int) -> int:
        """Parameters of decoder layer ``layer`` (0-based): attention, its two norms and the MLP,
        a dense ``3 * H * dense_intermediate`` MLP in the first :attr:`first_dense` layers, else
        :attr:`moe_params`. As in the checkpoint's ``state_dict``, DeepSeek-V3's and GLM-4.5's
        score-correction bias (a buffer) included.

        Raises:
            ValueError: ``layer`` outside ``0..num_layers - 1``.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1} of {self.name}")
        mlp = 3 * self.hidden * self.dense_intermediate if layer < self.first_dense else self.moe_params
        return self.attention_params + 2 * self.norm_params + mlp

    def checkpoint_bytes(self, layers: int, dtype_bytes: int) -> int:
        """Bytes of a checkpoint of the first ``layers`` decoder layers at ``dtype_bytes`` per
        element: those layers (dense-first ones dense), untied embeddings and LM head (+ Phi's LM
        head bias), final norm.

        Raises:
            ValueError: ``layers`` outside ``1..num_layers``.
        """
        if not 1 <= layers <= self.num_layers:
            raise ValueError(f"{layers} layers: {self.name} has 1..{self.num_layers}")
        head_bias = self.vocab if self.extra.get("lm_head_bias") else 0
        outer = 2 * self.vocab * self.hidden + head_bias + self.norm_params
        return dtype_bytes * (sum(self.layer_params(i) for i in range(layers)) + outer)


SHAPES: dict[str, RealShape] = {
    s.name: s
    for s in (
        RealShape(
            "mixtral-8x7b", "mixtral", "huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json",
            num_layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=32000,
            experts=8, top_k=2, moe_intermediate=14336, dense_intermediate=0, shared_intermediate=0,
            qk_norm="none", attention_bias=False, norm_topk_prob=True, rope_theta=1e6,
            rms_norm_eps=1e-5, max_position_embeddings=32768, sim_profile="mixtral-8x7b",
        ),
        RealShape(
            "qwen3-30b-a3b", "qwen3_moe", "huggingface.co/Qwen/Qwen3-30B-A3B config.json",
            num_layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936,
            experts=128, top_k=8, moe_intermediate=768, dense_intermediate=6144, shared_intermediate=0,
            qk_norm="head", attention_bias=False, norm_topk_prob=True, rope_theta=1e6,
            rms_norm_eps=1e-6, max_position_embeddings=40960, sim_profile="qwen3-30b-a3b",
        ),
        RealShape(
            "qwen2-moe-a2.7b", "qwen2_moe", "huggingface.co/Qwen/Qwen1.5-MoE-A2.7B config.json",
            num_layers=24, hidden=2048, heads=16, kv_heads=16, head_dim=128, vocab=151936,
            experts=60, top_k=4, moe_intermediate=1408, dense_intermediate=5632, shared_intermediate=5632,
            qk_norm="none", attention_bias=True, norm_topk_prob=False, rope_theta=1e6,
            rms_norm_eps=1e-6, max_position_embeddings=8192,
        ),
        RealShape(
            "olmoe-1b-7b", "olmoe", "huggingface.co/allenai/OLMoE-1B-7B-0924 config.json",
            num_layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128, vocab=50304,
            experts=64, top_k=8, moe_intermediate=1024, dense_intermediate=0, shared_intermediate=0,
            qk_norm="full", attention_bias=False, norm_topk_prob=False, rope_theta=1e4,
            rms_norm_eps=1e-5, max_position_embeddings=4096,
        ),
        RealShape(
            "deepseek-v2-lite", "deepseek_v2", "huggingface.co/deepseek-ai/DeepSeek-V2-Lite config.json",
            num_layers=27, hidden=2048, heads=16, kv_heads=16, head_dim=192, vocab=102400,
            experts=64, top_k=6, moe_intermediate=1408, dense_intermediate=10944, shared_intermediate=2816,
            qk_norm="none", attention_bias=False, norm_topk_prob=False, rope_theta=1e4,
            rms_norm_eps=1e-6, max_position_embeddings=163840,
            extra=dict(
                q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
                routed_scaling_factor=1.0, scoring_func="softmax",
                rope_parameters=dict(
                    rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                    beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
                ),
            ),
        ),
        RealShape(
            "deepseek-v3", "deepseek_v3", "huggingface.co/deepseek-ai/DeepSeek-V3 config.json",
            num_layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=192, vocab=129280,
            experts=256, top_k=8, moe_intermediate=2048, dense_intermediate=18432, shared_intermediate=2048,
            qk_norm="none", attention_bias=False, norm_topk_prob=True, rope_theta=1e4,
            rms_norm_eps=1e-6, max_position_embeddings=163840,
            extra=dict(
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_shared_experts=1, first_k_dense_replace=3, topk_method="noaux_tc", n_group=8, topk_group=4,
                routed_scaling_factor=2.5, scoring_func="sigmoid",
                rope_parameters=dict(
                    rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                    beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                ),
            ),
        ),
        RealShape(
            "glm-4.5-air", "glm4_moe", "huggingface.co/zai-org/GLM-4.5-Air config.json",
            num_layers=46, hidden=4096, heads=96, kv_heads=8, head_dim=128, vocab=151552,
            experts=128, top_k=8, moe_intermediate=1408, dense_intermediate=10944, shared_intermediate=1408,
            qk_norm="none", attention_bias=True, norm_topk_prob=True, rope_theta=1e6,
            rms_norm_eps=1e-5, max_position_embeddings=131072,
            extra=dict(
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                routed_scaling_factor=1.0, use_qk_norm=False, partial_rotary_factor=0.5,
            ),
        ),
        RealShape(
            "gpt-oss-20b", "gpt_oss", "huggingface.co/openai/gpt-oss-20b config.json",
            num_layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
            experts=32, top_k=4, moe_intermediate=2880, dense_intermediate=0, shared_intermediate=0,
            qk_norm="none", attention_bias=True, norm_topk_prob=True, rope_theta=150000.0,
            rms_norm_eps=1e-5, max_position_embeddings=131072,
            extra=dict(
                sliding_window=128, layer_types=("sliding_attention", "full_attention"), swiglu_limit=7.0,
                rope_parameters=dict(
                    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=4096, truncate=False,
                ),
            ),
        ),
        RealShape(
            "phi-3.5-moe", "phimoe",
            "huggingface.co/microsoft/Phi-3.5-MoE-instruct config.json; LongRoPE short/long factors set "
            "to 1.0 (not the published lists), mscales 1.0",
            num_layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=32064,
            experts=16, top_k=2, moe_intermediate=6400, dense_intermediate=0, shared_intermediate=0,
            qk_norm="none", attention_bias=True, norm_topk_prob=False, rope_theta=1e4,
            rms_norm_eps=1e-5, max_position_embeddings=131072,
            extra=dict(
                lm_head_bias=True, router_jitter_noise=0.01, sliding_window=131072,
                rope_parameters=dict(
                    rope_type="longrope", short_factor=[1.0] * 64, long_factor=[1.0] * 64, short_mscale=1.0,
                    long_mscale=1.0, original_max_position_embeddings=4096,
                ),
            ),
        ),
    )
}  # fmt: skip


def get_shape(name: str) -> RealShape:
    """Look up a shape by name.

    Raises:
        ConfigError: unknown name (one line with the choices).
    """
    if name not in SHAPES:
        raise ConfigError(f"--shape {name!r} is unknown (choose from {', '.join(SHAPES)})")
    return SHAPES[name]


def shrunk(shape: RealShape, factor: int) -> RealShape:
    """``shape`` with every width (hidden, head_dim, expert/dense/shared widths, vocab) divided by
    ``factor``; counts (layers, heads, experts, top-k) are kept. For tests only: a real shape of
    one layer is gigabytes.

    Raises:
        ConfigError: ``factor`` < 1, or a width it does not divide (head_dim must stay even for RoPE).
    """
    if factor == 1:
        return shape
    widths = {
        "hidden": shape.hidden,
        "head_dim": shape.head_dim,
        "moe_intermediate": shape.moe_intermediate,
        "dense_intermediate": shape.dense_intermediate,
        "shared_intermediate": shape.shared_intermediate,
        "vocab": shape.vocab,
    }
    extra = {k: v for k, v in shape.extra.items() if k in EXTRA_WIDTHS and v}
    bad = [k for k, v in {**widths, **extra}.items() if factor < 1 or v % factor]
    if bad or (shape.head_dim // factor) % 2 or (extra.get("qk_rope_head_dim", 2 * factor) // factor) % 2:
        raise ConfigError(
            f"--shrink {factor}: must divide {', '.join(bad) or 'head_dim'} of {shape.name} "
            "(and leave head_dim even)"
        )
    from dataclasses import replace

    new_extra = {**shape.extra, **{k: v // factor for k, v in extra.items()}}
    if "short_factor" in shape.extra.get("rope_parameters", {}):  # LongRoPE: one factor per pair
        rope = dict(shape.extra["rope_parameters"])
        for key in ("short_factor", "long_factor"):
            rope[key] = rope[key][: shape.head_dim // factor // 2]
        new_extra["rope_parameters"] = rope
    return replace(
        shape, name=f"{shape.name}/{factor}", extra=new_extra, **{k: v // factor for k, v in widths.items()}
    )


def hf_config(shape: RealShape, layers: int, dtype: str):
    """A ``transformers`` config of ``shape``'s family with ``layers`` decoder layers.

    ``dtype`` is written as the config's ``dtype`` (``bfloat16``, ``float16``, ``float32``).

    Raises:
        ConfigError: ``layers`` keeps only the dense-first layers (no MoE layer).
    """
    import transformers

    if layers <= shape.first_dense:
        raise ConfigError(
            f"--layers {layers}: {shape.name}'s first {shape.first_dense} layers are dense; keep at least "
            f"{shape.first_dense + 1} for an MoE layer"
        )
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        initializer_range=INITIALIZER_RANGE,
        num_experts_per_tok=shape.top_k,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        dtype=dtype,
    )
    family = {
        "mixtral": dict(num_local_experts=shape.experts, intermediate_size=shape.moe_intermediate),
        "qwen3_moe": dict(
            num_experts=shape.experts,
            moe_intermediate_size=shape.moe_intermediate,
            intermediate_size=shape.dense_intermediate,
            head_dim=shape.head_dim,
            norm_topk_prob=shape.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "qwen2_moe": dict(
            num_experts=shape.experts,
            moe_intermediate_size=shape.moe_intermediate,
            intermediate_size=shape.dense_intermediate,
            shared_expert_intermediate_size=shape.shared_intermediate,
            norm_topk_prob=shape.norm_topk_prob,
            qkv_bias=shape.attention_bias,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "olmoe": dict(
            num_experts=shape.experts,
            intermediate_size=shape.moe_intermediate,
            norm_topk_prob=shape.norm_topk_prob,
        ),
        "gpt_oss": dict(
            num_local_experts=shape.experts, intermediate_size=shape.moe_intermediate, head_dim=shape.head_dim
        ),
        "phimoe": dict(
            num_local_experts=shape.experts,
            intermediate_size=shape.moe_intermediate,
            attention_bias=shape.attention_bias,
        ),
    }
    deepseek_like = dict(  # DeepSeek-V2/V3 and GLM-4.5: routed + shared experts, dense-first layers
        n_routed_experts=shape.experts,
        moe_intermediate_size=shape.moe_intermediate,
        intermediate_size=shape.dense_intermediate,
        norm_topk_prob=shape.norm_topk_prob,
        attention_bias=shape.attention_bias,
    )
    for name in ("deepseek_v2", "deepseek_v3"):
        family[name] = deepseek_like
    family["glm4_moe"] = {**deepseek_like, "head_dim": shape.head_dim}
    extra = dict(shape.extra)
    if "rope_parameters" in extra:
        extra["rope_parameters"] = {"rope_theta": shape.rope_theta, **extra["rope_parameters"]}
    if "partial_rotary_factor" in extra:  # transformers 5 reads it from rope_parameters
        factor = extra.pop("partial_rotary_factor")
        extra["rope_parameters"] = {**common["rope_parameters"], "partial_rotary_factor": factor}
    if "layer_types" in extra:  # a pattern, repeated over the kept layers
        pattern = extra["layer_types"]
        extra["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    kwargs = {**common, **family[shape.model_type], **extra}
    cfg = transformers.AutoConfig.for_model(shape.model_type, **kwargs)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg
