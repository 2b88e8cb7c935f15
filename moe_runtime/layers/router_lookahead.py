"""Router lookahead: guess the experts of the next MoE layers from the current residual stream.

The residual stream changes little from one decoder layer to the next, so applying a *later*
layer's RMSNorm and router to the hidden state entering the current layer predicts that later
layer's routing well ahead of time — the speculative expert loading of Mixtral-Offloading
(Eliseev & Mazur, 2023, §3.2) and the pre-gating idea of Pre-gated MoE (Hwang et al., ISCA'24).
On the bundled model the guess from a layer's input residual has a per-token top-4 precision of
0.65 one MoE layer ahead, 0.58 two ahead and 0.49 three ahead on decode tokens (``moeserve bench
lookahead``), against 0.21 for EAMC matching (``moeserve trace predict-eval``; both in
docs/results.md). The ``eam`` prefetch policy blends it into its plan for the nearest layers; the
EAMC still plans the layers further away and drives the cache policy.

gpt-oss's routers carry a bias (added to the logits) and take the softmax over the top-k logits
only; the guess is the same full softmax of the biased logits, which ranks experts as that router
does.

Cost per MoE layer: one normalisation, one ``[T, H] x [H, D*E]`` matmul and a softmax over
``[T, D, E]``; the later
layers' RMSNorm weights are folded into their routers once (``rms_norm(x) @ R.T`` equals
``normalise(x) @ (R * g).T``); for a LayerNorm (Phi-3.5-MoE) ``x`` is centred first and the
bias term ``R @ b`` is added to the logits. The result is copied to the host after the router's own top-k ids,
so it adds no extra device->host synchronisation.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from moe_runtime.config import ModelConfig


class RouterLookahead:
    """Speculative routing scores of the ``depth`` MoE layers after each MoE layer.

    Args:
        cfg: model shape (``moe_layers`` maps MoE index -> decoder layer).
        dense: canonical dense weights (``layers.{i}.mlp_norm``, ``layers.{i}.router``).
        depth: later MoE layers scored, >= 1.
        policy: the prefetch policy the scores are for, or None. When given, :meth:`scores` asks
            its ``wants_lookahead(moe_layer)`` first (None, no work, while the policy is
            on-demand) and, while its ``plan_timed`` is true (the plan's host time is measured),
            reports its own host CPU time to ``note_lookahead_time(seconds)``, a cost the
            policy's gate weighs.

    Raises:
        ValueError: ``depth < 1``.
    """

    def __init__(
        self, cfg: ModelConfig, dense: dict[str, torch.Tensor], depth: int, policy: Any | None = None
    ) -> None:
        if depth < 1:
            raise ValueError(f"router lookahead depth must be >= 1, got {depth}")
        self.depth = depth
        self.eps = cfg.rms_norm_eps
        self.num_experts = cfg.num_experts
        self.centre = cfg.norm == "layer"
        fused, offsets = [], []
        for layer in cfg.moe_layers:
            p = f"layers.{layer}."
            router = dense[p + "router"]  # [E, H]
            folded = router.float() * dense[p + "mlp_norm"].float()[None, :]  # folded in fp32
            fused.append(folded.to(router.dtype))
            if self.centre:  # LayerNorm's bias b: + R @ b
                offsets.append(router.float() @ dense[p + "mlp_norm_bias"].float())
        self.routers = torch.cat(fused, dim=0)  # [L*E, H] in the model's dtype, norm weights folded in
        self.offsets = torch.cat(offsets) if offsets else None  # [L*E] fp32, LayerNorm only
        # routers with a bias (gpt-oss): the bias is added after the matmul, folding leaves it as is
        self.biases = (
            torch.cat([dense[f"layers.{layer}.router_logit_bias"] for layer in cfg.moe_layers])
            if cfg.router_logit_bias
            else None
        )  # [L*E] or None
        self.num_layers = len(fused)
        self.policy = policy
        # Per source MoE layer i, its targets' routers with the source decoder layer's attention
        # RMSNorm weight divided out, transposed: ``[H, D_i * E]``. The model hands
        # :meth:`scores` that norm's output ``g_attn * x / rms(x)``, which times these equals
        # ``(x / rms(x)) @ (R * g_mlp).T``: the lookahead then runs no normalisation of its own,
        # one matmul instead of 11 aten ops per planning layer (5 of them the norm's) on the
        # bundled model. None where that cannot hold: a LayerNorm (centred), or an attention
        # norm weight near 0 (dividing by it would blow up rounding).
        self.attn_folded: list[torch.Tensor | None] = []
        E = self.num_experts
        for i, layer in enumerate(cfg.moe_layers):
            first, last = i + 1, min(self.num_layers, i + 1 + depth)
            g = dense.get(f"layers.{layer}.attn_norm")
            if self.centre or first >= last or g is None:
                self.attn_folded.append(None)
                continue
            g = g.float()
            if bool((g.abs() < 1e-6 * max(float(g.abs().max()), 1e-30)).any()):
                self.attn_folded.append(None)
                continue
            block = self.routers[first * E : last * E].float() / g[None, :]  # [D_i * E, H]
            self.attn_folded.append(block.t().contiguous().to(self.routers.dtype))

    def logits(self, x: torch.Tensor, moe_layer: int) -> torch.Tensor | None:
        """Per-token router logits ``[T, D, E]`` (fp32) of MoE layers ``moe_layer + 1 ..
        moe_layer + D`` (D = ``depth``, fewer near the last layer) from the residual ``x [T, H]``
        entering ``moe_layer``'s decoder layer; None after the last MoE layer."""
        first = moe_layer + 1
        last = min(self.num_layers, first + self.depth)
        if first >= last:
            return None
        # one normalisation op (the norms' weights are folded into the routers): fewer ops per
        # planning layer than the textbook form
        norm = F.layer_norm if self.centre else F.rms_norm
        h = norm(x.float(), (x.shape[-1],), eps=self.eps).to(self.routers.dtype)  # [T, H]
        rows = slice(first * self.num_experts, last * self.num_experts)
        bias = None if self.biases is None else self.biases[rows]
        logits = F.linear(h, self.routers[rows], bias).float()
        if self.offsets is not None:
            logits = logits + self.offsets[rows]
        return logits.view(x.shape[0], last - first, self.num_experts)

    def scores(
        self, x: torch.Tensor, moe_layer: int, normed: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Expected routed-token counts ``[D, E]`` (fp32, on ``x``'s device) for the layers of
        :meth:`logits`: the sum over tokens of each later router's softmax. None after the last
        MoE layer, or while the policy does not want them (see the class).

        ``normed [T, H]``: optionally, ``x`` through its own decoder layer's attention RMSNorm
        (the model computes it anyway); the logits are then one matmul with :attr:`attn_folded`
        (the same figures up to rounding) instead of normalising ``x`` again."""
        policy = self.policy
        if policy is not None and not policy.wants_lookahead(moe_layer):
            return None
        # timed only when the policy measures the plan it is for (EAMPrefetch.plan_timed)
        timed = policy is not None and getattr(policy, "plan_timed", True)
        t0 = time.thread_time() if timed else 0.0
        folded = self.attn_folded[moe_layer] if normed is not None and moe_layer < self.num_layers else None
        if folded is not None:
            h = normed.to(folded.dtype)
            if self.biases is None:
                logits = torch.mm(h, folded)
            else:  # the target routers' biases, the rows ``folded``'s columns stand for
                first = (moe_layer + 1) * self.num_experts
                logits = torch.addmm(self.biases[first : first + folded.shape[1]], h, folded)
            logits = logits.float().view(x.shape[0], -1, self.num_experts)
        else:
            logits = self.logits(x, moe_layer)
        out = None if logits is None else F.softmax(logits, dim=-1).sum(dim=0)
        if timed:
            policy.note_lookahead_time(time.thread_time() - t0)
        return out
