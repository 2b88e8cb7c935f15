"""Hybrid expert execution in the simulator: each missed expert runs where it finishes first.

NOTE: the model. The runtime's placement (``moe_runtime.hybrid``, ``--expert-compute``) sends a
missed expert either over the link (copied, then computed on the device) or to one of ``P`` host
threads that compute it straight from host memory (Fiddler, KTransformers, llama.cpp's
``--n-cpu-moe``). Its split is HybriMoE's greedy intra-layer placement by expected finish time
(:func:`moe_runtime.hybrid.cost_model.place_layer`); :class:`SimPlacer` calls that function with
the inputs the runtime's :class:`~moe_runtime.hybrid.placement.HybridPlacer` builds under the
buffer's lock: the token rows of the resident, in-flight and missed experts, one copy's link time,
the link's backlog (copies in flight x link time) and the CPU lanes. Nothing of the split is
re-implemented here.

Times. A CPU job (one expert over its rows, one host thread) takes
``overhead + max(bytes / (B / P), rows x flops_per_row / (F / P))`` (:class:`CPUCost`; MoE-Lightning's
CPU roofs, Eqs. 1-3): each of the ``P`` lanes gets its share of the host's sustained memory
bandwidth ``B`` and peak ``F``, the share it has when every lane is busy. The placement predicts
with the runtime's two :class:`~moe_runtime.hybrid.cost_model.LinearCost` fits, built as the
runtime builds them: through the job time at 1 and 32 rows (the runtime measures its kernels
there at load), the CPU's refitted online from every finished job (the runtime's executor samples),
the device's from the roofline's expert time at 1 and 32 rows (its load-time probe; on CUDA it is
not refitted). Jobs queue on the lanes in ascending expert order, as the runtime's thread pool
takes them; the compute thread waits for the last one after its device batches (``cpu_wait_s``).

``cpu`` mode (llama.cpp's ``--n-cpu-moe``): each device's slots hold the last experts homed on it
in layer order, loaded once; every other expert runs on the CPU and nothing is copied
(``moe_runtime.hybrid.setup.preload_fixed``; the engine runs no prefetch and LRU then). ``device``
mode attaches nothing: the simulator runs exactly as without this module.

The hybrid bound per step: the step's missed experts' bytes over the link and the host's memory
together (``bytes / (link + B)``, a fluid split of the misses between the two), plus the resident
experts' weight reads from HBM and the step's dense part (attention, routers, LM head): a lower
bound on any placement's step time given the same misses.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_runtime.buffer.slots import READY
from moe_runtime.hybrid.cost_model import LayerCosts, LinearCost, place_layer
from moe_runtime.hybrid.setup import FIT_ROWS, fit_from

MODES = ("device", "cpu", "auto")


@dataclass(frozen=True, slots=True)
class CPUCost:
    """Seconds of one CPU job: ``overhead_s + max(bytes_s, flop_s_per_row x rows)``.

    Attributes:
        overhead_s: fixed host time per expert. bytes_s: reading the expert's weights at one
            lane's share of the host's memory bandwidth. flop_s_per_row: one row's FLOPs at one
            lane's share of the peak. label: how the numbers were obtained.
    """

    overhead_s: float
    bytes_s: float
    flop_s_per_row: float
    label: str = ""

    @classmethod
    def roofline(cls, expert_bytes: int, flops_per_row: float, host: Any, lanes: int) -> CPUCost:
        """The host's roofline per lane: ``lanes`` share its sustained bandwidth and its peak."""
        return cls(
            host.expert_overhead_us * 1e-6,
            expert_bytes * lanes / (host.mem_gbps * 1e9),
            flops_per_row * lanes / host.peak_flops,
            f"roofline ({host.name}, {lanes} lanes)",
        )

    @classmethod
    def measured(cls, per_expert_s: float, per_row_s: float, label: str = "measured") -> CPUCost:
        """A measured line ``per_expert_s + per_row_s x rows``."""
        return cls(per_expert_s, 0.0, per_row_s, label)

    def seconds(self, rows: int) -> float:
        return self.overhead_s + max(self.bytes_s, self.flop_s_per_row * rows)


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Hybrid execution settings of a simulation.

    Attributes:
        mode: ``device`` (every miss copied: the simulator as without hybrid execution), ``cpu``
            or ``auto`` (``--expert-compute``).
        lanes: host threads computing experts (the runtime's ``cpu_lanes``).
        cpu: one CPU job's time. bound_miss_s: a missed expert's seconds in the hybrid bound
            (``bytes / (link + host bandwidth)``); bound_hit_s: a resident one's (its weights
            read from HBM); either None: no bound.
    """

    mode: str = "device"
    lanes: int = 1
    cpu: CPUCost | None = None
    bound_miss_s: float | None = None
    bound_hit_s: float | None = None


class SimPlacer:
    """The runtime's :class:`~moe_runtime.hybrid.placement.HybridPlacer` on the event clock.

    Args:
        buffer: the :class:`~moeserve.sim.buffer.SimBuffer` it serves (its ``placer``).
        mode: ``cpu`` or ``auto``. lanes: CPU lanes (>= 1). cpu: a job's time.
        device_s: seconds the device takes for one expert over ``rows`` rows.
        expert_bytes: bytes per expert (the copies a CPU job avoids).
    """

    def __init__(self, buffer: Any, mode: str, lanes: int, cpu: CPUCost, device_s: Any, expert_bytes: int):
        if mode not in ("cpu", "auto"):
            raise ValueError(f"a placer runs cpu or auto, not {mode!r}")
        self.buffer, self.mode, self.lanes, self.cpu = buffer, mode, max(1, lanes), cpu
        self.expert_bytes = expert_bytes
        self.cpu_fit = fit_from((1, FIT_ROWS), [cpu.seconds(1), cpu.seconds(FIT_ROWS)])
        self.device_fit: LinearCost = fit_from((1, FIT_ROWS), [device_s(1), device_s(FIT_ROWS)])
        self.jobs: list[tuple[int, int]] = []  # the running layer's CPU jobs: (expert, rows)
        self._samples: list[tuple[int, float]] = []  # finished jobs, drained at the next split
        self._cpu_rows = 1.0  # running mean rows per CPU job (the gate's CPU time per miss)
        self.predicted_s = 0.0  # the last placement's predicted layer time

    @property
    def cpu_miss_seconds(self) -> float | None:
        """The CPU's seconds for one miss at the usual rows per job (``auto``; the prefetch gate's
        blocking per miss is capped by it); ``cpu``: None (it never prefetches)."""
        return self.cpu_fit.predict(self._cpu_rows) if self.mode == "auto" else None

    def split(self, layer: int, experts: list[int], counts: np.ndarray) -> list[int]:
        """Place the layer's ``experts`` (``counts [E]``: token rows per expert) as
        ``HybridPlacer.split`` does; returns the experts left for the lookup and keeps the CPU
        ones in :attr:`jobs`. Call after the layer's prefetches were settled."""
        for rows, seconds in self._samples:  # the executor's finished jobs refit the CPU's line
            self.cpu_fit.observe(1, rows, seconds)
            self._cpu_rows += 0.05 * (rows - self._cpu_rows)
        self._samples.clear()
        buf = self.buffer
        parts, home, base = buf.parts, buf._home, layer * buf.num_experts
        resident: list[list[int]] = [[] for _ in parts]
        inflight: list[list[int]] = [[] for _ in parts]
        miss: list[int] = []
        rows_of = [int(counts[e]) for e in experts]
        for i, e in enumerate(experts):
            d = home[base + e]
            part = parts[d]
            s = part.key_slot.get(base + e)
            if s is None:
                miss.append(i)
            elif part.state[s] == READY:
                resident[d].append(rows_of[i])
            else:
                inflight[d].append(rows_of[i])
        self.jobs = []
        if not miss:
            return experts
        link_s = [buf.transfer_s] * len(parts)  # the I/O threads' time per copy
        costs = LayerCosts(
            resident,
            inflight,
            [rows_of[i] for i in miss],
            [home[base + experts[i]] for i in miss],
            link_s,
            [p.loading * t for p, t in zip(parts, link_s)],
            self.lanes,
        )
        # the runtime keeps a second device fit for layers with CPU experts beside the device; it
        # differs from the first only on a CPU device (refitted there): on a GPU both stay the
        # load-time probe, as here
        placed = place_layer(costs, self.cpu_fit, self.device_fit, self.mode)
        self.predicted_s = placed.predicted_s
        on_cpu = {miss[j] for j, c in enumerate(placed.on_cpu) if c}
        if not on_cpu:
            return experts
        st = buf.stats
        for i in sorted(on_cpu):
            key = base + experts[i]
            part = parts[home[key]]
            if part.queue.cancel(key) is not None:  # its prefetch was for this use
                st.prefetch_cancelled += 1
            st.device_lookups[part.index] += 1
            self.jobs.append((experts[i], rows_of[i]))
        n = len(on_cpu)
        st.lookups[layer] += n
        st.cpu_experts[layer] += n
        st.cpu_avoided_bytes += n * self.expert_bytes
        return [e for i, e in enumerate(experts) if i not in on_cpu]

    def run_jobs(self, start: float) -> float:
        """Run :attr:`jobs` on the lanes from ``start`` (each on the earliest free lane, in
        ascending expert order, as the thread pool takes them); returns when the last ends."""
        lanes = [start] * min(self.lanes, len(self.jobs))
        st = self.buffer.stats
        for _, rows in self.jobs:
            i = lanes.index(min(lanes))
            seconds = self.cpu.seconds(rows)
            lanes[i] += seconds
            st.cpu_expert_s += seconds
            self._samples.append((rows, seconds))
        self.jobs = []
        return max(lanes)


def preload_fixed(buffer: Any) -> None:
    """``cpu`` mode's fixed set: each partition's slots hold the last experts homed on it in layer
    order (``moe_runtime.hybrid.setup.preload_fixed``), once."""
    for part in buffer.parts:
        if part.key_slot:  # every expert homed here fitted: resident already
            continue
        homed = np.flatnonzero(buffer.home == part.index).tolist()
        part.preload(homed[-part.num_slots :])


@dataclass
class StepTally:
    """Per measured step: the experts on the CPU, copied (demand copies and late prefetches) and
    resident, decode and prefill steps apart; and the hybrid bound per group, aggregated as TPOT
    is (the mean over a group's steps after its first, the median over groups)."""

    miss_s: float | None
    hit_s: float | None
    counts: dict[str, list[int]] = field(default_factory=lambda: {"decode": [0] * 4, "prefill": [0] * 4})
    groups: list[float] = field(default_factory=list)
    _group: list[float] = field(default_factory=list)

    def step(self, prefill: bool, lookups: int, hits: int, cpu: int, dense_s: float, first: bool) -> None:
        """One step's deltas: ``lookups``, ``hits``, ``cpu`` experts; ``dense_s`` its dense part."""
        c = self.counts["prefill" if prefill else "decode"]
        c[0] += 1
        c[1] += cpu
        c[2] += lookups - hits - cpu
        c[3] += hits
        if not first and self.miss_s is not None and self.hit_s is not None:
            self._group.append(dense_s + (lookups - hits) * self.miss_s + hits * self.hit_s)

    def end_group(self) -> None:
        self.groups.append(sum(self._group) / max(1, len(self._group)))
        self._group = []

    def summary(self) -> dict[str, Any]:
        """Per step kind: ``steps`` and the mean ``cpu``, ``copied``, ``resident`` experts per
        step; ``bound_s``: the hybrid bound of a step (None without one)."""
        out: dict[str, Any] = {}
        for kind, (steps, cpu, copied, resident) in self.counts.items():
            n = max(1, steps)
            out[kind] = {"steps": steps, "cpu": cpu / n, "copied": copied / n, "resident": resident / n}
        bound = self.miss_s is not None and self.hit_s is not None and self.groups
        out["bound_s"] = statistics.median(self.groups) if bound else None
        return out
