"""Configuration dataclasses: the model's shape (from ``config.json``) and the runtime's settings.

``ModelConfig`` is filled by a model family (``moe_runtime.models``) from a Hugging Face
``config.json``; ``RuntimeConfig`` holds everything the user chooses (device, dtype, buffer size,
link emulation, batching limits). Both reject bad values in ``__post_init__`` with a
:class:`~moe_runtime.errors.ConfigError` naming the field.

This module is the floor of the runtime: it imports only modules that import nothing from the
package (:mod:`moe_runtime.config_types` holds the family-specific values a ``ModelConfig``
carries), and it names the choices the user has (dtypes, expert formats, policies) rather than
importing the code that implements them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from moe_runtime.config_types import ClampedSwiGLU, LongRoPE, MLAShape, Routing, YarnScaling
from moe_runtime.device import normalize_device
from moe_runtime.errors import ConfigError
from tracer.eamc import DEFAULT_CAPACITY

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

#: ``--expert-dtype`` values: ``auto`` (the checkpoint's format), a float dtype, or a quantized format
#: (:mod:`moe_runtime.quant.select` turns one into a codec).
EXPERT_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8", "mxfp4")

#: Accepted range (inclusive) of each integer size in :class:`ModelConfig`. The upper bounds sit
#: far above every released MoE (largest today: vocabulary ~262k, hidden 16k, 128 layers, 384
#: experts, expert width 32k, context 10M); they exist to turn a corrupt or hostile
#: ``config.json`` into a clear error before any shape is computed. Whether the model then fits
#: in memory is checked separately (:mod:`moe_runtime.memory_plan`).
MODEL_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 16),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "num_experts": (1, 1 << 14),
    "top_k": (1, 1024),
    "moe_intermediate_size": (1, 1 << 18),
    "shared_expert_intermediate_size": (0, 1 << 18),
    "dense_intermediate_size": (0, 1 << 18),
    "max_position_embeddings": (2, 1 << 24),
}


@dataclass(slots=True)
class ModelConfig:
    """Shape and quirks of one MoE decoder checkpoint.

    Attributes:
        family: registry name of the model family (``mixtral``, ``qwen2_moe``, ...).
        architecture: ``config.json`` ``architectures[0]``.
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim: transformer shape.
        num_experts: routed experts per MoE layer (E); top_k: experts per token.
        moe_intermediate_size: hidden width of one routed expert's MLP.
        norm_topk_prob: renormalise the top-k softmax weights to sum to 1.
        router_weights_in_model_dtype: cast the top-k weights to the model dtype before use
            (Qwen/OLMoE do, Mixtral keeps fp32).
        shared_expert_intermediate_size: width of the always-on shared expert (0 = none); it is
            scaled by ``sigmoid(x @ shared_expert_gate)`` (Qwen2-MoE).
        dense_intermediate_size: width of the dense MLP in non-MoE layers.
        moe_layers: indices of decoder layers whose MLP is an MoE block; others are dense.
        qk_norm: ``"none"``, ``"head"`` (RMSNorm over head_dim per head, Qwen3) or ``"full"``
            (RMSNorm over the whole projection, OLMoE).
        attention_bias: q/k/v projections carry a bias (Qwen2-MoE).
        clip_qkv: clamp q, k, v to ``[-clip_qkv, clip_qkv]`` (OLMoE option).
        rope_theta: RoPE base; rms_norm_eps: RMSNorm epsilon.
        max_position_embeddings: the model's context length in tokens.
        tie_word_embeddings: the LM head shares the embedding matrix.
        bos_token_id / eos_token_ids: special tokens from the config (may be empty).
        shared_expert_gate: the shared expert is scaled by a sigmoid gate (Qwen2-MoE); DeepSeek's
            shared experts are added ungated.
        routing: top-k routing variant, a :class:`moe_runtime.config_types.Routing` (None: softmax
            top-k, the Mixtral/Qwen/OLMoE router; run by :mod:`moe_runtime.layers.routing`).
        attention_kind: ``"gqa"`` (grouped-query attention, the Llama layout) or ``"mla"``
            (DeepSeek's multi-head latent attention; ``mla`` holds its shape, a
            :class:`moe_runtime.config_types.MLAShape`, run by :mod:`moe_runtime.layers.mla`).
        norm: ``"rms"`` (RMSNorm, every family but one) or ``"layer"`` (LayerNorm with a bias, for
            the decoder and final norms: Phi-3.5-MoE; ``rms_norm_eps`` is its epsilon).
        rotary_dim: leading dims of each head RoPE turns (``partial_rotary_factor * head_dim``,
            GLM-4.5: half); None = the whole head.
        longrope: LongRoPE scaling (Phi-3.5-MoE), a :class:`moe_runtime.config_types.LongRoPE`.
        o_bias: the attention output projection carries a bias (Phi-3.5-MoE, gpt-oss;
            ``attention_bias`` covers q/k/v).
        lm_head_bias: the LM head carries a bias (Phi-3.5-MoE's ``lm_head_bias``).
        yarn: YaRN scaling of the GQA RoPE (gpt-oss), a :class:`moe_runtime.config_types.YarnScaling`;
            None = plain RoPE (MLA keeps its own in ``mla``).
        attention_sinks: each attention head has a learned sink logit ``sinks [heads]`` that joins
            the softmax denominator and carries no value (gpt-oss).
        sliding_window / sliding_layers: the decoder layers in ``sliding_layers`` let a query see
            only the last ``sliding_window`` positions (itself included); the others attend fully.
        router_logit_bias: the router is a linear layer with a bias ``[E]`` (gpt-oss).
        expert_bias: each routed expert's projections carry biases, kept resident per MoE layer
            as ``[E, 2I]`` (``[gate | up]``) and ``[E, H]`` (gpt-oss).
        expert_act: the experts' activation of ``(gate, up)``: None = ``silu(gate) * up``, or a
            :class:`moe_runtime.config_types.ClampedSwiGLU` (gpt-oss).
        quant_method: the checkpoint's ``quantization_config.quant_method`` (``fp8``, ``mxfp4``;
            None: unquantized); weight_block_size: fp8's ``[rows, cols]`` scale block. Set by the
            loader (:func:`moe_runtime.quant.parse_quantization`).

    Raises:
        ConfigError: an integer size outside :data:`MODEL_LIMITS`, an odd ``head_dim``, heads not
            a multiple of KV heads, top-k above the expert count, no MoE layer or one out of range,
            dense layers without a dense width, a non-finite or non-positive ``rope_theta``,
            ``rms_norm_eps`` or ``clip_qkv``, an ``attention_kind`` that does not match ``mla``,
            sliding layers out of range or without a ``sliding_window >= 1``.
            Messages name the field; the loader prefixes the
            ``config.json`` path.
    """

    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: list[int]
    router_weights_in_model_dtype: bool = True
    shared_expert_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    qk_norm: str = "none"
    attention_bias: bool = False
    clip_qkv: float | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    shared_expert_gate: bool = True
    routing: Routing | None = None
    attention_kind: str = "gqa"
    mla: MLAShape | None = None
    norm: str = "rms"
    rotary_dim: int | None = None
    longrope: LongRoPE | None = None
    o_bias: bool = False
    lm_head_bias: bool = False
    yarn: YarnScaling | None = None
    attention_sinks: bool = False
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)
    router_logit_bias: bool = False
    expert_bias: bool = False
    expert_act: ClampedSwiGLU | None = None
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name, (lo, hi) in MODEL_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates half the head)")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.top_k} exceeds the number of experts {self.num_experts}"
            )
        kind_ok = self.attention_kind == ("mla" if self.mla is not None else "gqa")
        if not kind_ok:
            raise ConfigError(
                f"attention_kind must be mla with an MLA shape, else gqa; got {self.attention_kind!r}"
            )
        if self.qk_norm not in ("none", "head", "full"):
            raise ConfigError(f"qk_norm must be none/head/full, got {self.qk_norm!r}")
        if self.norm not in ("rms", "layer"):
            raise ConfigError(f"norm must be rms or layer, got {self.norm!r}")
        rd = self.rotary_dim
        if rd is not None and (rd % 2 or not 2 <= rd <= self.head_dim):
            raise ConfigError(
                f"partial_rotary_factor gives {rd} rotary dims: must be even and in "
                f"[2, head_dim={self.head_dim}]"
            )
        if not self.moe_layers:
            raise ConfigError("the model has no MoE layer")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ConfigError(f"MoE layers {self.moe_layers} are not all in [0, {self.num_layers})")
        if len(self.moe_layers) < self.num_layers and self.dense_intermediate_size < 1:
            raise ConfigError(
                f"intermediate_size must be >= 1: {self.num_layers - len(self.moe_layers)} "
                "decoder layers have a dense MLP"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.clip_qkv is not None and not (math.isfinite(self.clip_qkv) and self.clip_qkv > 0):
            raise ConfigError(f"clip_qkv must be null or a finite number > 0, got {self.clip_qkv!r}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ConfigError(f"sliding layers {self.sliding_layers} are not all in [0, {self.num_layers})")
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(f"sliding_window must be an integer >= 1, got {self.sliding_window!r}")

    @property
    def num_moe_layers(self) -> int:
        """L in the paper's notation: the number of MoE layers."""
        return len(self.moe_layers)

    @property
    def layer_windows(self) -> dict[int, int]:
        """Sliding-window layer -> its window in positions (empty when every layer attends fully)."""
        return {layer: self.sliding_window for layer in self.sliding_layers}

    @property
    def kv_elements_per_token(self) -> int:
        """KV-cache elements one token takes in one layer: K and V of every KV head, or for MLA the
        latent (``kv_lora_rank``) and the shared rotary key (``qk_rope_head_dim``)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def expert_numel(self) -> int:
        """Elements of one packed expert: gate and up ``[I, H]`` each, then down ``[H, I]``."""
        return 3 * self.moe_intermediate_size * self.hidden_size


#: Largest ``--block-size``: a cached block keeps its tokens' expert counts in uint8
#: (``moe_runtime.engine.prefix_eam``), and longer blocks only coarsen prefix reuse.
MAX_BLOCK_SIZE = 128

DEFAULT_CACHE_POLICY = "eam-reuse"
"""The loop-aware next-use-distance cache: it closed the most of the on-demand-to-oracle gap in
the simulator on real Mixtral routing (docs/simulator.md)."""


#: Names of the cache policies, in the order of their registry
#: (:data:`moe_runtime.buffer.cache_policy.CACHE_POLICIES`); a new policy is added to both
#: (``tests/test_policies.py`` checks they agree).
CACHE_POLICY_NAMES = ("lru", "eam", "eam-reuse", "model-counts", "oracle")
#: Names of the prefetch policies, in the order of their registry
#: (:data:`moe_runtime.prefetch.PREFETCH_POLICIES`; checked as the cache policies are).
PREFETCH_POLICY_NAMES = ("on-demand", "next-layer-all", "model-counts", "hot-experts", "eam", "oracle")
#: ``--expert-compute`` values (:mod:`moe_runtime.hybrid`, docs/hybrid.md): where a needed expert that
#: is not in the device buffer runs.
EXPERT_COMPUTE_MODES = ("device", "cpu", "auto")
LOAD_FORMATS = ("safetensors", "dummy")


def cache_policy_names() -> list[str]:
    """Names in the cache-policy registry (:data:`CACHE_POLICY_NAMES`)."""
    return list(CACHE_POLICY_NAMES)


def prefetch_policy_names() -> list[str]:
    """Names in the prefetch-policy registry (:data:`PREFETCH_POLICY_NAMES`)."""
    return list(PREFETCH_POLICY_NAMES)


@dataclass(slots=True)
class RuntimeConfig:
    """Settings the user picks; CLI flags map one-to-one onto these fields.

    Attributes:
        device: compute device for dense layers and expert slots (``cpu``, ``cuda``, ``cuda:1``).
        num_devices: devices experts are spread over; an expert's home device is a hash of
            ``(layer, expert)`` (MoE-Infinity §5.3). On CPU these are emulated devices, each with
            its own buffer and I/O thread.
        dtype: ``bf16``, ``fp16`` or ``fp32`` for all weights and activations.
        buffer_slots: expert slots in total (split evenly over ``num_devices``); ``None`` derives
            it from ``buffer_fraction``.
        buffer_fraction: share of all experts the buffer holds (0, 1], used when
            ``buffer_slots`` is ``None``; 1.0 keeps every expert resident. ``None`` (both unset):
            the memory plan sizes the buffer where it knows the device's memory (CUDA, or
            ``device_memory``), else every expert is resident (``moe_runtime.memory_split``).
        link_gbps: emulated host->device bandwidth in GB/s (1e9 bytes/s); ``None`` = no emulation.
        link_latency_us: fixed emulated per-transfer latency in microseconds.
        max_batch_size: most sequences in one engine step.
        max_num_batched_tokens: most tokens (prefill + decode) in one engine step.
        max_model_len: KV-cache length per sequence; ``None`` = the model's context length
            capped at 4096.
        cache_policy / prefetch_policy: names from the policy registries (default: ``eam-reuse``
            cache, the loop-aware next-use-distance cache, and ``eam`` prefetch; cache: ``lru``,
            ``eam``, ``model-counts``, ``oracle``; prefetch: ``on-demand``,
            ``next-layer-all``, ``model-counts``, ``hot-experts``, ``oracle``). Unknown names are
            refused even when every expert is resident (the policies then have nothing to do).
        prefetch_depth: later layers a prefetch plan may cover (multi-layer lookahead); None = all.
        router_lookahead: next MoE layers whose ``eam`` prefetch plan also uses the router
            lookahead (later routers applied to the current residual stream; 0 = the paper's
            EAMC-only policy). See ``moe_runtime.layers.router_lookahead``.
        eamc_capacity: entries of the EAM collection the ``eam`` policies match against
            (``tracer.eamc.DEFAULT_CAPACITY``, 128: docs/tracer.md weighs prediction against
            matching cost by capacity).
        pin_memory: pin the host expert store (default: when the device is a GPU).
        expert_dtype: the format experts are kept in (host store, link, slots): ``auto`` = the
            checkpoint's (fp8 block-scaled experts stay fp8; unquantized ones are in ``dtype``),
            ``bf16``/``fp16``/``fp32``, ``fp8`` (e4m3, one scale per block), ``int8`` (one scale
            per output channel) or ``mxfp4``; quantized experts are dequantized to ``dtype`` where
            they run (:mod:`moe_runtime.quant`).
        cpu_threads: intra-op threads for CPU compute (``torch.set_num_threads``, process-wide);
            None leaves torch's default. The CLI defaults to 1: on small experts thread fan-out
            costs more than it gains, and the I/O threads and HTTP server need the other cores.
        block_size / num_kv_blocks / enable_prefix_caching: the paged KV cache
            (``moe_runtime.layers.kv_cache``, ``moe_runtime.engine.kv_manager``; docs/kv-cache.md):
            token positions per block (1..128; CUDA decodes read blocks in place at multiples of
            16), blocks in the pool (None: the memory plan's, ``memory_split``, else the memory
            of ``max_batch_size`` sequences of ``max_model_len``, ``memory_plan.kv_num_blocks``),
            and reuse of cached prompt prefixes across requests (vLLM's block hashing; on by
            default).
        gpu_memory_utilization: share (0, 1] of the device's memory the memory plan may take
            (dense weights, activations, KV cache and expert slots; vLLM's flag of that name).
        device_memory: bytes standing in for the compute device's memory (on the CPU, where the
            "device" is host memory, so the plan and its tests run without an accelerator);
            None: CUDA's own, and no plan on the CPU.
        kv_cache_memory: bytes of KV cache (whole blocks of it); fixes the KV side of the plan as
            ``num_kv_blocks`` does (give one of them).
        plan_data: trace files (``moeserve-trace/1``) or EAMC files the memory plan reads the
            traffic's sequence lengths and the expert hit-rate curve from (docs/operations.md
            "Sizing"); empty: the built-in defaults.
        cuda_graphs: replay decode steps from CUDA graphs where FlexAttention decodes: the whole
            step per batch size when every expert is resident and routed on the device
            (``engine.decode_graphs``), else each layer's attention block per batch size
            (``layers.attention_graphs``); False runs every step eagerly (``--enforce-eager``).
            No effect off CUDA.
        compile_decode: on the CPU, run decode steps through one ``torch.compile``d forward
            where every expert is resident (``engine.compiled_decode``; ``moeserve serve``'s
            default there, ``--enforce-eager`` off). Off by default in the engine API: each engine
            compiles once, tens of seconds on a small host. No effect off the CPU.
        load_format: ``safetensors`` reads the checkpoint's weights; ``dummy`` reads only its
            ``config.json`` and draws random weights in memory (``moe_runtime.dummy_weights``):
            a model's speed without its weights, meaningless outputs.
    """

    device: str = "cpu"
    num_devices: int = 1
    dtype: str = "fp32"
    buffer_slots: int | None = None
    buffer_fraction: float | None = None
    link_gbps: float | None = None
    link_latency_us: float = 0.0
    max_batch_size: int = 16
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    cache_policy: str = DEFAULT_CACHE_POLICY
    prefetch_policy: str = "eam"
    prefetch_depth: int | None = None
    router_lookahead: int = 1
    eamc_capacity: int = DEFAULT_CAPACITY
    pin_memory: bool | None = None
    cpu_threads: int | None = None
    expert_dtype: str = "auto"
    # hybrid expert execution (moe_runtime.hybrid)
    expert_compute: str | None = None
    cpu_expert_threads: int | None = None
    # paged KV cache (moe_runtime.layers.kv_cache, moe_runtime.engine.kv_manager)
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # memory plan (moe_runtime.memory_split)
    gpu_memory_utilization: float = 0.9
    device_memory: int | None = None
    kv_cache_memory: int | None = None
    plan_data: tuple[str, ...] = ()
    # decode steps replayed from CUDA graphs (moe_runtime.engine.decode_graphs)
    cuda_graphs: bool = True
    # decode steps through torch.compile on the CPU (moe_runtime.engine.compiled_decode)
    compile_decode: bool = False
    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            formats = ", ".join(LOAD_FORMATS)
            raise ConfigError(f"--load-format must be one of {formats}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of bf16, fp16, fp32, got {self.dtype!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(
                f"--expert-dtype must be one of {', '.join(EXPERT_DTYPES)}, got {self.expert_dtype!r}"
            )
        if self.buffer_slots is not None and self.buffer_slots < 1:
            raise ConfigError(f"--buffer-slots must be >= 1, got {self.buffer_slots}")
        if self.buffer_fraction is not None and not 0 < self.buffer_fraction <= 1:
            raise ConfigError(f"--buffer-fraction must be in (0, 1], got {self.buffer_fraction}")
        util = self.gpu_memory_utilization
        if not 0 < util <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
        sizes = (("--device-memory", self.device_memory), ("--kv-cache-memory", self.kv_cache_memory))
        for flag, value in sizes:
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1 byte, got {value}")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ConfigError("give --kv-cache-memory or --num-kv-blocks, not both")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise ConfigError(f"--link-gbps must be > 0, got {self.link_gbps}")
        if self.link_latency_us < 0:
            raise ConfigError(f"--link-latency-us must be >= 0, got {self.link_latency_us}")
        if self.num_devices < 1:
            raise ConfigError(f"--num-devices must be >= 1, got {self.num_devices}")
        if self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefetch_depth is not None and self.prefetch_depth < 1:
            raise ConfigError(f"--prefetch-depth must be >= 1, got {self.prefetch_depth}")
        if self.router_lookahead < 0:
            raise ConfigError(f"--router-lookahead must be >= 0, got {self.router_lookahead}")
        if self.eamc_capacity < 1:
            raise ConfigError(f"--eamc-capacity must be >= 1, got {self.eamc_capacity}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.expert_compute is not None and self.expert_compute not in EXPERT_COMPUTE_MODES:
            modes = ", ".join(EXPERT_COMPUTE_MODES)
            raise ConfigError(f"--expert-compute must be one of {modes}, got {self.expert_compute!r}")
        if self.cpu_expert_threads is not None and self.cpu_expert_threads < 1:
            raise ConfigError(f"--cpu-expert-threads must be >= 1, got {self.cpu_expert_threads}")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"--block-size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        for flag, name, known in (
            ("--cache-policy", self.cache_policy, cache_policy_names()),
            ("--prefetch-policy", self.prefetch_policy, prefetch_policy_names()),
        ):
            if name not in known:
                raise ConfigError(f"{flag} {name!r} is unknown (choose from {', '.join(known)})")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"--device {self.device!r} is not a device: {exc}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def expert_compute_mode(self) -> str:
        """``expert_compute``, or its default: ``auto`` where experts cross a link (a CUDA device,
        or an emulated ``link_gbps``), else ``device`` (a CPU device without a link: copying is a
        memcpy and the "device" is the CPU, so the modes compute alike)."""
        if self.expert_compute is not None:
            return self.expert_compute
        crosses = self.link_gbps is not None or torch.device(self.device).type != "cpu"
        return "auto" if crosses else "device"

    @property
    def torch_device(self) -> torch.device:
        """``device`` normalised (``cuda`` -> the current CUDA device with its index); see
        :func:`moe_runtime.device.normalize_device` for the errors."""
        return normalize_device(self.device)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
