"""Cost model: how long an expert copy, an expert's compute and a layer's dense part take.

NOTE: roofline (MoE-Lightning §3, HRM Eqs. 4-8, and its §4.2 performance model ``T_x =
max(comm_x, comp_x)``). An operator that reads ``bytes`` from device memory and performs
``flops`` takes ``max(flops / P_peak, bytes / B_hbm)`` on the device: an expert run for ``n``
tokens reads its weights once (plus ``n`` input and output rows) and does ``2 * params * n``
FLOPs, so it is memory-bound for small ``n`` (decode) and compute-bound past ``n ~ P/B``. The
host->device copy of an expert is the cross-level roof (Eq. 6): ``latency + bytes / link`` (the
same formula as the runtime's :class:`~moe_runtime.io.link.LinkModel`). The dense part of a layer
(attention, router, dense MLP) reads its weights and the KV cache of the step's context.

:class:`CostModel` also takes measured numbers instead of the roofline (calibration against the
runtime): a per-expert time as ``a + b * tokens`` and fixed per-layer and per-step times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeserve.sim.hardware import HardwareProfile
from moeserve.sim.models import ModelProfile

ACT_BYTES = 2  # BF16 activations


@dataclass(slots=True)
class CostModel:
    """Seconds per simulated operation.

    Attributes:
        transfer_s: one expert host->device copy (latency + bytes / bandwidth).
        expert_fixed_s, expert_bytes_s, expert_flop_s_per_token, expert_io_s_per_token: the expert
            roofline ``fixed + max(flop * n, bytes + io * n)``; measured models set
            ``expert_bytes_s = a`` and ``expert_io_s_per_token = b`` (``a + b * n``).
        layer_fixed_s: per MoE layer and step, before routing, on top of the dense roofline (host
            work: the top-k copy to the host, the policies' bookkeeping; measured: everything).
        layer_bytes_s, layer_flop_s_per_token: the dense part's roofline ``max(bytes, flop * n)``.
        kv_s_per_ctx_token: per MoE layer and context token attended (KV-cache read).
        step_fixed_s: per step (LM head, sampling, scheduling).
        plan_s: per MoE layer, between looking the layer's experts up (demand copies start) and
            its first expert (the prefetch policy's planning; measured models only).
        wake_s: after waiting for a copy, the compute thread resumes this long after it landed
            (a threaded runtime's hand-back: notify, thread wake-up; 0 on a GPU's event wait).
        label: how the numbers were obtained (printed with results).
    """

    transfer_s: float
    expert_fixed_s: float = 0.0
    expert_bytes_s: float = 0.0
    expert_flop_s_per_token: float = 0.0
    expert_io_s_per_token: float = 0.0
    layer_fixed_s: float = 0.0
    layer_bytes_s: float = 0.0
    layer_flop_s_per_token: float = 0.0
    kv_s_per_ctx_token: float = 0.0
    step_fixed_s: float = 0.0
    plan_s: float = 0.0
    wake_s: float = 0.0
    label: str = ""

    @classmethod
    def roofline(cls, model: ModelProfile, hw: HardwareProfile, host_overhead_us: float = 0.0) -> CostModel:
        """Data-sheet roofline of ``model`` on ``hw``; ``host_overhead_us`` is added per MoE layer
        (the router's device->host sync and the policies' Python work, 0 by default)."""
        hbm = hw.gpu.hbm_gbps * 1e9
        peak = hw.gpu.peak_flops
        return cls(
            transfer_s=hw.link.latency_us * 1e-6 + model.expert_bytes / (hw.link.gbps * 1e9),
            expert_bytes_s=model.expert_bytes / hbm,
            expert_flop_s_per_token=model.expert_flops_per_token / peak,
            expert_io_s_per_token=2 * model.hidden * ACT_BYTES / hbm,
            layer_fixed_s=host_overhead_us * 1e-6,
            layer_bytes_s=model.layer_dense_bytes / hbm,
            layer_flop_s_per_token=2 * model.layer_dense_bytes / model.weight_bytes / peak,
            kv_s_per_ctx_token=model.kv_bytes_per_token / model.num_layers / hbm,
            step_fixed_s=model.head_bytes / hbm,
            label=f"roofline ({hw.name}, {model.name})",
        )

    @classmethod
    def measured(
        cls,
        transfer_s: float,
        expert_a_s: float,
        expert_b_s: float,
        layer_fixed_s: float,
        layer_b_s: float,
        step_fixed_s: float,
        wake_s: float = 0.0,
        label: str = "measured",
        plan_s: float = 0.0,
    ) -> CostModel:
        """Linear measured model: an expert for ``n`` tokens takes ``a + b * n`` seconds, a layer's
        dense part ``layer_fixed_s + layer_b_s * n``, a step adds ``step_fixed_s``."""
        return cls(
            transfer_s=transfer_s,
            expert_bytes_s=expert_a_s,
            expert_io_s_per_token=expert_b_s,
            layer_fixed_s=layer_fixed_s,
            layer_flop_s_per_token=layer_b_s,
            step_fixed_s=step_fixed_s,
            plan_s=plan_s,
            wake_s=wake_s,
            label=label,
        )

    def expert_s(self, tokens: int) -> float:
        """Seconds to run one expert for ``tokens`` tokens (:meth:`experts_s` of one count)."""
        return float(self.experts_s(tokens))

    def experts_s(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds to run one expert for each element of ``tokens`` (any shape; float64): the
        roofline ``fixed + max(flop * n, bytes + io * n)``. The simulator computes a step's
        expert times with one call."""
        t = np.asarray(tokens, dtype=np.float64)
        return self.expert_fixed_s + np.maximum(
            self.expert_flop_s_per_token * t, self.expert_bytes_s + self.expert_io_s_per_token * t
        )

    def layer_s(self, tokens: int, ctx_tokens: int) -> float:
        """Seconds of a MoE layer's dense part for a step of ``tokens`` new tokens attending
        ``ctx_tokens`` cached ones in total."""
        dense = max(self.layer_bytes_s, self.layer_flop_s_per_token * tokens)
        return self.layer_fixed_s + dense + self.kv_s_per_ctx_token * ctx_tokens

    def describe(self) -> dict[str, float | str]:
        """Key figures in microseconds, for the settings line."""
        return {
            "cost_model": self.label,
            "transfer_us": round(self.transfer_s * 1e6, 2),
            "expert_us_1tok": round(self.expert_s(1) * 1e6, 2),
            "layer_us_1tok": round(self.layer_s(1, 0) * 1e6, 2),
            "step_fixed_us": round(self.step_fixed_s * 1e6, 2),
            "wake_us": round(self.wake_s * 1e6, 2),
        }
