"""Model profiles for the simulator: expert size, MoE shape, resident (dense) weights, KV bytes.

Each profile is built from the architecture numbers of the model's published ``config.json`` (cited
per profile; ``docs/simulator.md`` repeats them), so parameter counts are computed, not typed in.
An expert of a SwiGLU model is three ``H x I`` matrices (gate, up, down), of a ReLU FFN model two;
one token through it costs ``2 * params`` FLOPs (a multiply and an add per weight). *Dense*
parameters are everything that stays on the device (embeddings, attention, routers, dense MLPs,
shared experts, LM head). ``L`` counts MoE layers only; encoder-decoder models (Switch, NLLB) are
simulated as their stack of MoE layers run once per token, the view their EAMs take (MoE-Infinity
§4.1).

Buffer slots (MoE-Infinity §5.3, "memory management"): GPU memory minus the dense weights, a KV
reserve (``kv_tokens`` tokens of KV cache) and a fixed runtime reserve (CUDA context, allocator
slack, activations), divided by the expert size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from moe_runtime.errors import ConfigError
from moeserve.sim.hardware import GiB, HardwareProfile

DEFAULT_KV_TOKENS = 8192  # KV reserve: e.g. 4 sequences x 2048 tokens (assumption)
RUNTIME_RESERVE_BYTES = 1 * GiB  # CUDA context, allocator slack, activations (assumption)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Sizes of one MoE model as served (bytes use ``weight_bytes`` per parameter).

    Attributes:
        num_layers: ``L`` MoE layers; num_experts: ``E`` routed experts per layer; top_k: ``k``.
        hidden: ``H``; expert_intermediate: ``I``; expert_mats: 3 (SwiGLU) or 2 (ReLU FFN).
        weight_bytes: bytes per expert parameter (2 = BF16, 1 = FP8).
        dense_params: resident parameters; dense_bytes: their bytes on the device.
        head_bytes: LM-head bytes (read once per step); embed_head_bytes: embeddings + LM head.
        kv_bytes_per_token: KV-cache bytes per token over all layers.
        source: where the numbers come from; mapped_from: set when the shape comes from a trace.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    expert_intermediate: int
    expert_mats: int
    weight_bytes: float
    dense_params: int
    dense_bytes: int
    head_bytes: int
    embed_head_bytes: int
    kv_bytes_per_token: int
    source: str
    mapped_from: str | None = None

    @property
    def expert_params(self) -> int:
        return self.expert_mats * self.hidden * self.expert_intermediate

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert: one transfer over the link."""
        return int(self.expert_params * self.weight_bytes)

    @property
    def expert_flops_per_token(self) -> int:
        return 2 * self.expert_params

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def layer_dense_bytes(self) -> float:
        """Dense bytes read per MoE layer and step (attention, dense MLP, router; not head/embeddings)."""
        return (self.dense_bytes - self.embed_head_bytes) / self.num_layers

    def buffer_slots(
        self,
        hw: HardwareProfile,
        kv_tokens: int = DEFAULT_KV_TOKENS,
        reserve_bytes: int = RUNTIME_RESERVE_BYTES,
    ) -> int:
        """Slots that fit in one GPU next to the dense weights and the reserves (capped at L*E).

        Raises:
            ConfigError: the dense weights and reserves leave no room for one expert.
        """
        kv = self.kv_bytes_per_token * kv_tokens
        free = hw.gpu.memory_bytes - self.dense_bytes - kv - reserve_bytes
        slots = math.floor(free / self.expert_bytes)
        if slots < 1:
            raise ConfigError(
                f"--model-profile {self.name}: dense weights {self.dense_bytes / GiB:.1f} GiB + KV reserve "
                f"{kv / GiB:.1f} GiB + {reserve_bytes / GiB:.1f} GiB leave no room for one "
                f"{self.expert_bytes / 2**20:.0f} MiB expert on {hw.gpu.name} "
                f"({hw.gpu.memory_bytes / GiB:.0f} GiB); pass --buffer-slots"
            )
        return min(slots, self.total_experts)

    def mapped(self, num_layers: int, num_experts: int, top_k: int) -> ModelProfile:
        """This profile's per-expert and per-layer costs on a trace of another shape (e.g. the
        bundled tiny model's routing replayed at Mixtral's expert size); labelled as such."""
        if (num_layers, num_experts, top_k) == (self.num_layers, self.num_experts, self.top_k):
            return self
        label = f"{self.name} costs on a L={num_layers} E={num_experts} k={top_k} trace"
        dense = int(self.layer_dense_bytes * num_layers + self.embed_head_bytes)
        return replace(
            self,
            name=label,
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            dense_bytes=dense,
            mapped_from=self.name,
        )


def _gqa(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Parameters of one attention block: q and o (``H x heads*d``), k and v (``H x kv*d``)."""
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _profile(
    name: str,
    *,
    moe_layers: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    mats: int,
    wbytes: float,
    other_dense: int,
    vocab: int,
    tied: bool,
    kv_per_token: int,
    source: str,
    head_bytes: float | None = None,
) -> ModelProfile:
    routers = moe_layers * hidden * experts
    head = hidden * vocab
    embed_and_head = head if tied else 2 * head
    dense = other_dense + routers + embed_and_head
    hb = wbytes if head_bytes is None else head_bytes
    dense_bytes = int((other_dense + routers) * wbytes + embed_and_head * hb)
    return ModelProfile(
        name, moe_layers, experts, top_k, hidden, inter, mats, wbytes, dense, dense_bytes,
        int(head * hb), int(embed_and_head * hb), kv_per_token, source,
    )  # fmt: skip


def _build() -> dict[str, ModelProfile]:
    p: dict[str, ModelProfile] = {}
    # Mixtral-8x7B: huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json (hidden 4096,
    # intermediate 14336, 32 layers, 8 experts, top-2, 32 heads, 8 KV heads, head_dim 128, vocab
    # 32000, untied); Jiang et al. 2024 (arXiv 2401.04088) Table 1. BF16. 46.7B params in total.
    p["mixtral-8x7b"] = _profile(
        "mixtral-8x7b", moe_layers=32, experts=8, top_k=2, hidden=4096, inter=14336, mats=3, wbytes=2,
        other_dense=32 * _gqa(4096, 32, 8, 128), vocab=32000, tied=False,
        kv_per_token=32 * 2 * 8 * 128 * 2, source="HF mistralai/Mixtral-8x7B-v0.1; arXiv 2401.04088",
    )  # fmt: skip
    # Switch-base-128: huggingface.co/google/switch-base-128 config.json (d_model 768, d_ff 3072,
    # 12+12 layers, every 2nd FFN sparse -> 6+6 = 12 MoE layers, 128 experts, top-1, ReLU FFN,
    # 12 heads x 64, vocab 32128, shared embeddings); Fedus et al. 2022 (arXiv 2101.03961).
    # Served in BF16 (assumption). Dense: 12 encoder self-attn, 12 decoder self+cross attn, 12 dense FFNs.
    p["switch-base-128"] = _profile(
        "switch-base-128", moe_layers=12, experts=128, top_k=1, hidden=768, inter=3072, mats=2, wbytes=2,
        other_dense=(12 + 24) * 4 * 768 * 768 + 12 * 2 * 768 * 3072, vocab=32128, tied=True,
        kv_per_token=12 * 2 * 768 * 2, source="HF google/switch-base-128 config.json; arXiv 2101.03961",
    )  # fmt: skip
    # NLLB-MoE-54B: huggingface.co/facebook/nllb-moe-54b config.json (d_model 2048, ffn 8192, 24+24
    # layers, every 4th FFN sparse -> 6+6 = 12 MoE layers, 128 experts, top-2, ReLU FFN, vocab
    # 256206, shared embeddings); NLLB Team 2022 (arXiv 2207.04672). BF16 (assumption).
    p["nllb-moe-128"] = _profile(
        "nllb-moe-128", moe_layers=12, experts=128, top_k=2, hidden=2048, inter=8192, mats=2, wbytes=2,
        other_dense=(24 + 48) * 4 * 2048 * 2048 + 36 * 2 * 2048 * 8192, vocab=256206, tied=True,
        kv_per_token=24 * 2 * 2048 * 2, source="HF facebook/nllb-moe-54b config.json; arXiv 2207.04672",
    )  # fmt: skip
    # Arctic (128 x 3.66B experts = 128 experts per layer of 3 x 7168 x 4864 over 35 layers):
    # huggingface.co/Snowflake/snowflake-arctic-instruct config.json (hidden 7168, intermediate 4864,
    # 35 layers, 128 experts, top-2, 56 heads, 8 KV heads, vocab 32000, a dense residual SwiGLU
    # MLP of 4864 beside every MoE layer); Snowflake's Arctic announcement (480B total, 17B active).
    # BF16. Computed dense 8.3B (Snowflake rounds the dense part to "10B").
    p["arctic-128x4b"] = _profile(
        "arctic-128x4b", moe_layers=35, experts=128, top_k=2, hidden=7168, inter=4864, mats=3, wbytes=2,
        other_dense=35 * (_gqa(7168, 56, 8, 128) + 3 * 7168 * 4864), vocab=32000, tied=False,
        kv_per_token=35 * 2 * 8 * 128 * 2, source="HF Snowflake/snowflake-arctic-instruct config.json",
    )  # fmt: skip
    # Qwen3-30B-A3B: huggingface.co/Qwen/Qwen3-30B-A3B config.json (hidden 2048, moe_intermediate
    # 768, 48 layers, 128 experts, top-8, 32 heads, 4 KV heads, head_dim 128, vocab 151936,
    # untied); 30.5B params in total (Qwen3 technical report, arXiv 2505.09388). BF16.
    p["qwen3-30b-a3b"] = _profile(
        "qwen3-30b-a3b", moe_layers=48, experts=128, top_k=8, hidden=2048, inter=768, mats=3, wbytes=2,
        other_dense=48 * _gqa(2048, 32, 4, 128), vocab=151936, tied=False,
        kv_per_token=48 * 2 * 4 * 128 * 2, source="HF Qwen/Qwen3-30B-A3B config.json; arXiv 2505.09388",
    )  # fmt: skip
    # DeepSeek-V3: huggingface.co/deepseek-ai/DeepSeek-V3 config.json (hidden 7168, moe_intermediate
    # 2048, 61 layers of which the first 3 dense (intermediate 18432) -> 58 MoE layers, 256 routed
    # + 1 shared expert, top-8, MLA: q_lora 1536, kv_lora 512, 128 heads, qk 128+64, v 128; vocab
    # 129280); arXiv 2412.19437 (671B total). Weights FP8 (1 byte, block scales negligible),
    # embeddings and head BF16. KV cache: MLA latent 512 + rope 64 per layer, BF16.
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    p["deepseek-v3"] = _profile(
        "deepseek-v3", moe_layers=58, experts=256, top_k=8, hidden=7168, inter=2048, mats=3, wbytes=1,
        other_dense=61 * mla + 3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048, vocab=129280, tied=False,
        kv_per_token=61 * 576 * 2, head_bytes=2, source="HF deepseek-ai/DeepSeek-V3; arXiv 2412.19437",
    )  # fmt: skip
    return p


MODELS: dict[str, ModelProfile] = _build()


def get_model(name: str) -> ModelProfile:
    """Look up a model profile by name.

    Raises:
        ConfigError: unknown name (one line with the choices).
    """
    if name not in MODELS:
        raise ConfigError(f"--model-profile {name!r} is unknown (choose from {', '.join(MODELS)})")
    return MODELS[name]
