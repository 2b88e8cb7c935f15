"""The two lower bounds on a step that ``moeserve bench decode`` reports beside its times
(milliseconds), and the bytes they count.

- **HBM bound**: bytes a step must read from device memory, at the device's memory bandwidth
  (:func:`moeserve.bench.hardware.hbm_gbps`: a data-sheet table by CUDA device name, a measured
  copy bandwidth on the CPU, or ``--hbm-gbps``). Bytes read = resident dense weights (the
  embedding table counts only as the LM head when tied; latent attention, shared experts and
  dense-first layers are dense weights) + every distinct expert the step used (measured lookups;
  gpt-oss' resident per-expert biases count with their expert, not as dense weights) + the KV cache
  of every sequence at its mean context length over the run (sliding-window layers at most their
  window; DeepSeek's latent cache row per layer).
- **Link bound**: bytes moved host->device per decode step (measured: demand + prefetch copies) at
  the link's bandwidth: measured in this run for copies of one expert (pinned, CUDA events; the
  fastest of 5) when no link is emulated, else the emulated ``link_gbps`` plus ``link_latency_us`` per copy.

A prefill row has the same bounds over its prefill steps (weights and experts read, KV written;
bytes moved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bounds:
    """What the bounds divide by. ``hbm_gbps``: device memory bandwidth; ``h2d_gbps``: measured
    host->device copies of one expert; ``link_latency_us``: emulated per-copy latency."""

    hbm_gbps: float
    h2d_gbps: float
    expert_bytes: int
    dense_read_bytes: int
    kv_bytes_per_token: int
    link_latency_us: float

    def hbm_ms(self, nbytes: float) -> float:
        """Milliseconds to read ``nbytes`` from device memory."""
        return 1e3 * nbytes / (self.hbm_gbps * 1e9)

    def link_ms(self, moved: float, link_gbps: float | None) -> float:
        """Milliseconds to move ``moved`` bytes host->device: measured bandwidth, or the emulated
        link (bandwidth plus latency per expert copy)."""
        if link_gbps is None:
            return 1e3 * moved / (self.h2d_gbps * 1e9)
        return 1e3 * moved / (link_gbps * 1e9) + (moved / self.expert_bytes) * self.link_latency_us * 1e-3


#: resident per-expert tensors (gpt-oss' expert biases): a step reads only the rows of the experts it uses
EXPERT_RESIDENT = ("expert_gate_up_bias", "expert_down_bias")


def _is_expert_resident(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_RESIDENT


def dense_read_bytes(dense: dict[str, torch.Tensor]) -> int:
    """Dense bytes a forward pass reads: all resident weights (attention, latent attention, norms,
    routers and their biases, shared experts, dense-first MLPs, LM head) but the embedding table,
    which is read as the LM head only when tied (no separate ``lm_head``), and the per-expert
    biases (:func:`expert_read_bytes` counts them with their expert)."""
    total = sum(t.numel() * t.element_size() for n, t in dense.items() if not _is_expert_resident(n))
    embed, head = dense.get("embed"), dense.get("lm_head")
    if embed is not None and head is not None and head.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def expert_read_bytes(loaded) -> int:
    """Bytes a step reads for one routed expert it uses: its packed weights
    (``store.expert_nbytes``) plus its rows of the resident per-expert biases (gpt-oss: ``2I + H``)."""
    cfg = loaded.config
    bias = sum(t.numel() * t.element_size() for n, t in loaded.dense.items() if _is_expert_resident(n))
    return loaded.store.expert_nbytes + bias // (cfg.num_moe_layers * cfg.num_experts)


def kv_read_bytes(cfg, context: float, kv_bytes_per_token: int) -> float:
    """KV bytes one sequence at ``context`` tokens reads in a decode step over all layers, from
    ``kv_bytes_per_token`` (one token, all layers): a sliding-window layer of ``cfg`` (gpt-oss)
    reads at most ``cfg.sliding_window`` tokens."""
    sliding = len(cfg.sliding_layers)
    window = min(context, cfg.sliding_window) if sliding else 0
    return kv_bytes_per_token / cfg.num_layers * ((cfg.num_layers - sliding) * context + sliding * window)
