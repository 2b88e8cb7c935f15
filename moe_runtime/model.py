"""Our own forward pass of an MoE decoder over a packed step (no transformers modules).

``forward(input_ids [T], step) -> logits [N, V]`` for the N tokens that sample. Per decoder layer:
RMSNorm (LayerNorm for Phi-3.5-MoE) -> q/k/v projections (+bias) -> q/k norm (per head or full) ->
RoPE (partial, LongRoPE, YaRN) -> attention with the KV cache -> o projection (+bias) -> residual ->
RMSNorm -> MoE block (or dense MLP) -> residual. DeepSeek families attend with multi-head latent
attention instead (``moe_runtime.layers.mla``); gpt-oss adds attention sinks, sliding-window layers
and biased experts with its own activation (``moe_runtime.models.gpt_oss``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.config import ModelConfig
from moe_runtime.engine.context import StepContext
from moe_runtime.layers.attention import attention
from moe_runtime.layers.experts import ExpertFFN, select_expert_path
from moe_runtime.layers.kv_cache import PagedKVCache
from moe_runtime.layers.mla import MLAttention
from moe_runtime.layers.mla_cache import PagedMLACache
from moe_runtime.layers.moe import moe_block
from moe_runtime.layers.norm import decoder_norm, rms_norm
from moe_runtime.layers.rotary import Rotary
from moe_runtime.layers.router_lookahead import RouterLookahead


class MoEModel:
    """Dense weights on the device, experts through ``buffer``.

    Args:
        cfg: model shape. dense: canonical name -> device tensor (see ``moe_runtime.models.base``).
        buffer: the expert buffer. kv_cache: the paged KV cache (or the latent one for
            latent attention). max_len: positions RoPE covers.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dense: dict[str, torch.Tensor],
        buffer: ExpertBuffer,
        kv_cache: PagedKVCache | PagedMLACache,
        max_len: int,
    ) -> None:
        self.cfg = cfg
        self.w = dense
        self.buffer = buffer
        self.kv = kv_cache
        emb = dense["embed"]
        self.rotary = Rotary(
            cfg.head_dim,
            cfg.rope_theta,
            max_len,
            emb.dtype,
            emb.device,
            cfg.rotary_dim,
            cfg.longrope,
            cfg.yarn,
        )
        self.mla = MLAttention(cfg, max_len, emb.dtype, emb.device) if cfg.attention_kind == "mla" else None
        self.lm_head = dense["embed"] if cfg.tie_word_embeddings else dense["lm_head"]
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        # per MoE layer: the experts' biases and activation when not the plain SwiGLU (gpt-oss)
        self.ffn: dict[int, ExpertFFN] = {}
        if cfg.expert_bias or cfg.expert_act is not None:
            for layer in cfg.moe_layers:
                p = f"layers.{layer}."
                self.ffn[layer] = ExpertFFN(
                    dense.get(p + "expert_gate_up_bias"), dense.get(p + "expert_down_bias"), cfg.expert_act
                )
        self.recorder: Any | None = None
        self.prefetcher: Any | None = None
        self.lookahead: RouterLookahead | None = None  # set when the prefetch policy uses it
        # ``grouped`` (one grouped GEMM per projection) or ``loop``: probed once, on this device/dtype
        # quantized slots: each used expert is dequantized (to the compute dtype) where it runs;
        # the loop path dequantizes exactly the used slots, a grouped call would also dequantize
        # the unused slots its span covers (moe_runtime.quant.layout.DequantSlots)
        self.expert_path = (
            "loop"
            if buffer.store.layout is not None
            else select_expert_path(emb.device, emb.dtype, cfg.hidden_size, cfg.moe_intermediate_size)
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        x = F.embedding(input_ids, w["embed"])  # [T, H]
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            ahead = None
            h = decoder_norm(x, w, p + "attn_norm", cfg.norm, cfg.rms_norm_eps)
            la = self.lookahead  # (skipped while the policy plans nothing: its scores would be None)
            if (
                la is not None
                and step.observe
                and layer in self.moe_index
                and not getattr(la.policy, "idle", 0)
            ):
                ahead = la.scores(x, self.moe_index[layer], normed=h)  # from the layer's input
            x = x + self._attention(h, layer, step)
            h = decoder_norm(x, w, p + "mlp_norm", cfg.norm, cfg.rms_norm_eps)
            if layer in self.moe_index:
                h = moe_block(
                    h,
                    w,
                    layer,
                    self.moe_index[layer],
                    cfg,
                    self.buffer,
                    step,
                    self.recorder,
                    self.prefetcher,
                    ahead,
                    self.expert_path,
                    self.ffn.get(layer),
                )
            else:
                h = F.linear(
                    F.silu(F.linear(h, w[p + "mlp_gate"])) * F.linear(h, w[p + "mlp_up"]), w[p + "mlp_down"]
                )
            x = x + h
        x = decoder_norm(x[step.logits_index], w, "final_norm", cfg.norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head, w.get("lm_head_bias")).float()  # [N, V]

    def _attention(self, x: torch.Tensor, layer: int, step: StepContext) -> torch.Tensor:
        if self.mla is not None:  # DeepSeek's multi-head latent attention
            return self.mla(x, self.w, layer, self.kv, step)
        cfg, w, p = self.cfg, self.w, f"layers.{layer}."
        t = x.shape[0]
        q = F.linear(x, w[p + "q"], w.get(p + "q_bias"))
        k = F.linear(x, w[p + "k"], w.get(p + "k_bias"))
        v = F.linear(x, w[p + "v"], w.get(p + "v_bias"))
        if cfg.qk_norm == "full":
            q = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (z.clamp(-cfg.clip_qkv, cfg.clip_qkv) for z in (q, k, v))
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        q, k = self.rotary.apply(q, k, step.positions)
        out = attention(q, k, v, layer, self.kv, step, w.get(p + "sinks"))  # sliding windows per block group
        return F.linear(out, w[p + "o"], w.get(p + "o_bias"))  # [T, H]
