"""Our own forward pass of an MoE decoder over a packed step (no transformers modules).

``forward(input_ids [T], step) -> logits [N, V]`` for the N tokens that sample. Per decoder layer:
RMSNorm (LayerNorm for Phi-3.5-MoE) -> one q/k/v projection (+bias) -> q/k norm (per head or full) ->
RoPE (partial, LongRoPE, YaRN) -> attention with the KV cache -> o projection (+bias) -> residual ->
RMSNorm -> MoE block (or dense MLP) -> residual. DeepSeek families attend with multi-head latent
attention instead (``moe_runtime.layers.mla``); gpt-oss adds attention sinks, sliding-window layers
and biased experts with its own activation (``moe_runtime.models.gpt_oss``).

Host work per layer is what a decode step costs on a GPU (every aten op is a kernel launch and a
trip through the dispatcher), so the layer is laid out for few ops (docs/architecture.md):

* q, k and v come from one matmul over weights concatenated at load (:class:`DenseLayer`; the
  checkpoint's ``q``/``k``/``v`` names stay in the dense dict as views of it), and stay in that
  output: the per-head q/k norm writes its result back into the query and key heads, RoPE turns
  them there in one pass (:meth:`Rotary.rotate_`), and the keys and values, adjacent in it, go into
  the KV cache with one ``index_copy_`` (``moe_runtime.layers.kv_cache``);
* what every layer shares within a step is computed once per step: the cos/sin rows of the step's
  positions, the decodes' gather slots and masks (``StepContext``);
* the o projection and the residual are one ``addmm`` (the weight kept transposed at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.config import ModelConfig
from moe_runtime.engine.context import StepContext
from moe_runtime.layers.attention import attention
from moe_runtime.layers.experts import ExpertFFN, select_expert_path
from moe_runtime.layers.graph_capture import WHOLE_STEP
from moe_runtime.layers.kv_cache import PagedKVCache
from moe_runtime.layers.mla import MLAttention
from moe_runtime.layers.mla_cache import PagedMLACache
from moe_runtime.layers.moe import moe_block
from moe_runtime.layers.norm import layer_norm, rms_norm
from moe_runtime.layers.resident_experts import DEVICE_ROUTED, ResidentSpans, finish_step, resident_spans
from moe_runtime.layers.rotary import Rotary
from moe_runtime.layers.router_lookahead import RouterLookahead


@dataclass(slots=True)
class DenseLayer:
    """One decoder layer's dense weights, resolved once at load (no name lookups per step).

    Attributes:
        prefix: ``layers.{i}.``, for the weights read per call (``sinks``: tests switch it off).
        attn_norm, mlp_norm: ``[H]`` norm weights; ``*_bias`` LayerNorm biases or None.
        qkv: ``[(Hq + 2 Hkv) * D, H]`` the q, k and v projections in one (None: latent attention);
            qkv_bias: its bias or None.
        qk_norm: ``[Hq + Hkv, 1, D]`` the per-head q/k norm weights side by side (``qk_norm ==
            "head"``), or None. q_norm, k_norm: ``[Hq * D]``/``[Hkv * D]`` (``"full"``) or None.
        o_t: ``[Hq * D, H]`` the o projection transposed (for ``addmm``); o_bias: its bias or None.
        mlp: a dense layer's ``(gate_up [2I, H], down [H, I])``, or None for an MoE layer.
    """

    prefix: str
    attn_norm: torch.Tensor
    attn_norm_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    mlp_norm_bias: torch.Tensor | None
    qkv: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_t: torch.Tensor | None
    o_bias: torch.Tensor | None
    mlp: tuple[torch.Tensor, torch.Tensor] | None


#: device type -> whether dense matmul weights ``[out, in]`` are kept column-major (``[in, out]`` in
#: memory, a transposed view under the same name): ``F.linear`` then hands the CPU's BLAS a
#: row-major right operand, whose few-row kernels stream it (on the 2-core EPYC host, one decode
#: token through the bundled model's LM head: 154 us instead of 550, qkv 23 instead of 48, caches
#: cold; equal from 8 rows on). cuBLAS reads either layout.
COLUMN_MAJOR: dict[str, bool] = {"cpu": True}
# the per-layer and global dense matmul weights it applies to (experts live in the slots, as stored)
_MATMUL_NAMES = ("router", "shared_gate_proj", "shared_up", "shared_down", "shared_gate", "mlp_down")


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t [out, in]`` with the same values, laid out ``[in, out]`` (a transposed view)."""
    return t.t().contiguous().t()


def _fuse_rows(dense: dict[str, torch.Tensor], names: list[str], column_major: bool) -> torch.Tensor | None:
    """The tensors ``names`` concatenated along dim 0 (laid out column-major if asked), with each
    dict entry replaced by its view into the result (same values and sizes, no second copy kept);
    None if any is missing."""
    parts = [dense.get(n) for n in names]
    if any(t is None for t in parts):
        return None
    fused = torch.cat(parts)  # type: ignore[arg-type]
    if column_major and fused.dim() == 2:
        fused = _column_major(fused)
    for n, view in zip(names, fused.split([t.shape[0] for t in parts])):  # type: ignore[union-attr]
        dense[n] = view
    return fused


def dense_layers(cfg: ModelConfig, dense: dict[str, torch.Tensor]) -> list[DenseLayer]:
    """Every decoder layer's :class:`DenseLayer`, fusing q/k/v (and a dense MLP's gate/up) and
    transposing o in ``dense`` in place (and, where :data:`COLUMN_MAJOR`, laying the matmul weights
    out column-major): its entries keep their names, shapes and values (as views of the fused or
    relaid tensors), so the memory plan's count and the checkpoint's names still hold."""
    out = []
    moe = set(cfg.moe_layers)
    cm = COLUMN_MAJOR.get(dense["embed"].device.type, False)
    if cm:  # the LM head (the embedding too when tied: its lookup reads the columns)
        name = "embed" if cfg.tie_word_embeddings else "lm_head"
        dense[name] = _column_major(dense[name])
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        qkv = qkv_bias = qk_norm = o_t = mlp = None
        if cm:
            for n in _MATMUL_NAMES:
                if dense.get(p + n) is not None and dense[p + n].dim() == 2:
                    dense[p + n] = _column_major(dense[p + n])
        if cfg.attention_kind != "mla":
            qkv = _fuse_rows(dense, [p + "q", p + "k", p + "v"], cm)
            qkv_bias = _fuse_rows(dense, [p + "q_bias", p + "k_bias", p + "v_bias"], False)
            if cfg.qk_norm == "head":
                qk_norm = torch.cat(
                    (
                        dense[p + "q_norm"].expand(cfg.num_heads, cfg.head_dim),
                        dense[p + "k_norm"].expand(cfg.num_kv_heads, cfg.head_dim),
                    )
                ).unsqueeze(1)  # [Hq + Hkv, 1, D]
        o = dense.get(p + "o")
        if o is not None:
            o_t = o.t().contiguous()
            dense[p + "o"] = o_t.t()  # the same [H, Hq * D] values, now a view of o_t
        if layer not in moe:
            gate_up = _fuse_rows(dense, [p + "mlp_gate", p + "mlp_up"], cm)
            mlp = (gate_up, dense[p + "mlp_down"])
        full = cfg.qk_norm == "full"
        out.append(
            DenseLayer(
                prefix=p,
                attn_norm=dense[p + "attn_norm"],
                attn_norm_bias=dense.get(p + "attn_norm_bias"),
                mlp_norm=dense[p + "mlp_norm"],
                mlp_norm_bias=dense.get(p + "mlp_norm_bias"),
                qkv=qkv,
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                q_norm=dense[p + "q_norm"] if full else None,
                k_norm=dense[p + "k_norm"] if full else None,
                o_t=o_t,
                o_bias=dense.get(p + "o_bias"),
                mlp=mlp,  # type: ignore[arg-type]
            )
        )
    return out


class MoEModel:
    """Dense weights on the device, experts through ``buffer``.

    Args:
        cfg: model shape. dense: canonical name -> device tensor (see ``moe_runtime.models.base``);
            q/k/v (and a dense MLP's gate/up) become views of fused tensors, o a transposed view
            (:func:`dense_layers`).
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
        self.layers = dense_layers(cfg, dense)
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
        # decode steps' attention blocks from CUDA graphs (layers.attention_graphs), set by the engine
        self.segments: Any | None = None
        # ``grouped`` (one grouped GEMM per projection) or ``loop``: probed once, on this device/dtype
        # quantized slots: each used expert is dequantized (to the compute dtype) where it runs;
        # the loop path dequantizes exactly the used slots, a grouped call would also dequantize
        # the unused slots its span covers (moe_runtime.quant.layout.DequantSlots)
        self.device = emb.device
        self._spans: ResidentSpans | None | bool = False  # False: not built yet
        self.expert_path = (
            "loop"
            if buffer.store.layout is not None
            else select_expert_path(emb.device, emb.dtype, cfg.hidden_size, cfg.moe_intermediate_size)
        )

    def _resident(self, step: StepContext | None = None) -> ResidentSpans | None:
        """The fully resident layers' slot views where they run device-routed, while the prefetch
        policy plans nothing (built at the first call: the engine sets the policy after load). On
        the CPU only inside a whole compiled step (``step.memo[WHOLE_STEP]``; None: any step)."""
        if self._spans is False:
            self._spans = resident_spans(
                self.buffer, self.cfg.num_moe_layers, self.cfg.num_experts, self.device, self.expert_path
            )
        pf = self.prefetcher
        if pf is not None and getattr(pf, "name", "") != "on-demand":
            return None
        if step is not None and not DEVICE_ROUTED.get(self.device.type) and not step.memo.get(WHOLE_STEP):
            return None
        return self._spans  # type: ignore[return-value]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:  # LayerNorm (cfg.norm == "layer")
            return layer_norm(x, weight, bias, self.cfg.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Logits ``[N, V]`` (fp32) of the step's ``input_ids [T]``: the device work
        (:meth:`forward_device`), then the host's per-step work of the device-routed layers
        (``finish_step``: their router ids' one copy to the host, the buffer's counters, the
        tracer)."""
        logits = self.forward_device(input_ids, step)
        finish_step(step.device_routed, self.buffer, step, self.recorder, self.cfg.num_experts)
        return logits

    @torch.inference_mode()
    def forward_device(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The forward pass up to the logits; the device-routed layers' ``(layer, ids, weights)``
        are left in ``step.device_routed`` for :meth:`forward`'s host work. With every expert
        resident and routed on the device, a decode step here has no host sync, so a CUDA graph
        can capture it (``moe_runtime.engine.decode_graphs``)."""
        cfg, w = self.cfg, self.w
        x = F.embedding(input_ids, w["embed"])  # [T, H]
        # each layer's attention block from a CUDA graph (decode steps, offloaded experts)
        seg = self.segments.begin(step) if self.segments is not None else None
        rope = None  # cos/sin rows [T, 1, 1, D], once per step
        if self.mla is None and seg is None:
            rope = tuple(r.unsqueeze(1) for r in self.rotary.rows(step.positions))
        la = self.lookahead if step.observe else None
        resident = self._resident(step)  # the same for every layer of the step
        for layer, lw in enumerate(self.layers):
            ahead = None
            h = self._norm(x, lw.attn_norm, lw.attn_norm_bias)
            moe_layer = self.moe_index.get(layer)
            # (skipped while the policy plans nothing: its scores would be None)
            if la is not None and moe_layer is not None and not getattr(la.policy, "idle", 0):
                ahead = la.scores(x, moe_layer, normed=h)  # from the layer's input
            if seg is not None:
                x, h = seg.run(layer, lw, h, x)
            else:
                x = self._attention(h, x, lw, layer, step, rope)  # residual included
                h = self._norm(x, lw.mlp_norm, lw.mlp_norm_bias)
            if moe_layer is not None:
                h = moe_block(
                    h,
                    w,
                    layer,
                    moe_layer,
                    cfg,
                    self.buffer,
                    step,
                    self.recorder,
                    self.prefetcher,
                    ahead,
                    self.expert_path,
                    self.ffn.get(layer),
                    resident,
                )
            else:
                gate_up, down = lw.mlp  # type: ignore[misc]
                gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
                h = F.linear(F.silu(gate) * up, down)
            x = x + h
        if not (step.logits_all and step.logits_index.shape[0] == x.shape[0]):  # else all, in order
            x = x[step.logits_index]
        x = self._norm(x, w["final_norm"], w.get("final_norm_bias"))
        logits = F.linear(x, self.lm_head, w.get("lm_head_bias"))  # [N, V]
        return logits if logits.dtype == torch.float32 else logits.float()

    def _attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        lw: DenseLayer,
        layer: int,
        step: StepContext,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """``residual + o(attention(x))`` for the normed ``x [T, H]``."""
        if self.mla is not None:  # DeepSeek's multi-head latent attention
            out = self.mla(x, self.w, layer, self.kv, step)
        else:
            out = self._gqa(x, lw, layer, step, rope)  # type: ignore[arg-type]
        if lw.o_bias is not None:
            return residual + F.linear(out, lw.o_t.t(), lw.o_bias)  # type: ignore[union-attr]
        return torch.addmm(residual, out, lw.o_t)  # type: ignore[arg-type]

    def _gqa(
        self,
        x: torch.Tensor,
        lw: DenseLayer,
        layer: int,
        step: StepContext,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Grouped-query attention of the normed ``x [T, H]`` -> ``[T, Hq * D]`` (before o)."""
        cfg = self.cfg
        t, hq, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # type: ignore[arg-type]  # [T, (Hq + 2 Hkv) * D]
        if lw.q_norm is not None:  # OLMoE: over the whole projection, written back in place
            q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]
            rms_norm(q, lw.q_norm, cfg.rms_norm_eps, out=q)
            rms_norm(k, lw.k_norm, cfg.rms_norm_eps, out=k)  # type: ignore[arg-type]
        if cfg.clip_qkv is not None:
            qkv.clamp_(-cfg.clip_qkv, cfg.clip_qkv)
        # per head, with a query length of 1 (the decode SDPA's layout, and the cache's for K/V)
        heads = qkv.view(t, hq + 2 * hkv, 1, d)
        qk = heads[:, : hq + hkv]  # queries then keys, a view
        if lw.qk_norm is not None:  # Qwen3: per head, both in one call
            rms_norm(qk, lw.qk_norm, cfg.rms_norm_eps, out=qk)
        self.rotary.rotate_(qk, *rope)
        sinks = self.w.get(lw.prefix + "sinks")  # read per call: tests switch it off
        q, kv = heads.split([hq, 2 * hkv], dim=1)  # one op: the queries, the keys and values
        # sliding windows per block group
        out = attention(q, None, None, layer, self.kv, step, sinks, kv=kv)
        return out  # [T, Hq * D]
