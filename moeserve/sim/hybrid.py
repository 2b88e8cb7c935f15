"""Hybrid expert execution in the simulator: each missed expert runs where it finishes first.

NOTE: the model. The runtime's placement (``moe_runtime.hybrid``, ``--expert-compute``) sends a
missed expert either over the link (copied, then computed on the device) or to the host's CPU
pool, which computes it straight from host memory (Fiddler, KTransformers, llama.cpp's
``--n-cpu-moe``). Its split is HybriMoE's greedy intra-layer placement by expected finish time
(:func:`moe_runtime.hybrid.cost_model.place_layer`); :class:`SimPlacer` calls that function with
the inputs the runtime's :class:`~moe_runtime.hybrid.placement.HybridPlacer` builds under the
buffer's lock: the token rows of the resident, in-flight and missed experts, one copy's link time,
the link's backlog (copies in flight x link time) and one CPU lane. Nothing of the split is
re-implemented here.

Times. The runtime's pool splits each CPU expert over all its ``P`` threads by ranges of output
rows (llama.cpp's and KTransformers' split of a matrix product over threads), so it is one lane
that runs the layer's CPU experts one after another. An expert takes ``overhead`` plus, for each
of its two phases (gate/up, then down), ``max(bytes / B_P, rows x flops / F_P, (R - 1) x unit +
one range at one core's rates)`` (:class:`CPUCost`; MoE-Lightning's CPU roofs, Eqs. 1-3): ``B_P``
the socket's sustained memory bandwidth, at most ``P`` times one core's read rate
(:meth:`~moeserve.sim.hardware.HostProfile.pool_gbps`), ``F_P`` the sustained FLOP/s of ``P``
cores (the data-sheet peak times the measured share the runtime's kernel reaches,
:meth:`~moeserve.sim.hardware.HostProfile.pool_flops`); ``R`` the runtime's ranges in the phase
(:func:`~moe_runtime.hybrid.executor.split_ranges`), whose Python (``unit``) the threads take in
turn on the GIL, so the last range starts ``(R - 1) x unit`` late. The placement predicts
with the runtime's two :class:`~moe_runtime.hybrid.cost_model.LinearCost` fits, built as the
runtime builds them: through the expert time at 1 and 32 rows (the runtime measures its kernels
there at load, on the whole pool), the CPU's refitted online from every CPU expert's time (the
runtime's executor samples), the device's from the roofline's expert time at 1 and 32 rows (its
load-time probe; on CUDA it is not refitted). The compute thread waits for the last CPU expert
after its device batches (``cpu_wait_s``).

``cpu`` mode (llama.cpp's ``--n-cpu-moe``): each device's slots hold the last experts homed on it
in layer order, loaded once; every other expert runs on the CPU and nothing is copied
(``moe_runtime.hybrid.setup.preload_fixed``; the engine runs no prefetch and LRU then). ``device``
mode attaches nothing: the simulator runs exactly as without this module.

The hybrid bound per step: the step's missed experts' bytes over the link and the host's memory
together (``bytes / (link + B_P)``, a fluid split of the misses between the two), plus the resident
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
from moe_runtime.hybrid.executor import MIN_UNIT_BYTES, split_ranges
from moe_runtime.hybrid.setup import FIT_ROWS, fit_from, fixed_keys

MODES = ("device", "cpu", "auto")


@dataclass(frozen=True, slots=True)
class CPUCost:
    """Seconds of one CPU expert on the pool.

    Without ``phases``: ``overhead_s + max(bytes_s, flop_s_per_row x rows)``. With them (the
    runtime's split: gate/up, then down), ``overhead_s`` plus, per phase ``(bytes_s, flop_s_per_row,
    stagger_s, range_bytes_s, range_flop_s_per_row)``, the largest of: its weights at the pool's read
    rate, its FLOPs at the pool's sustained rate, and its last range's start (``stagger_s``: the
    ranges before it take the GIL in turn) plus that range at one core's rates.

    Attributes:
        overhead_s: fixed host time per expert. bytes_s: reading the expert's weights at the
            pool's read rate. flop_s_per_row: one row's FLOPs at the pool's sustained FLOP/s.
        label: how the numbers were obtained. phases: see above (empty: one phase, no stagger).
    """

    overhead_s: float
    bytes_s: float
    flop_s_per_row: float
    label: str = ""
    phases: tuple[tuple[float, float, float, float, float], ...] = ()

    @classmethod
    def pool(cls, profile: Any, host: Any, threads: int) -> CPUCost:
        """The runtime's pool of ``threads`` threads on one of ``profile``'s experts, split as the
        runtime splits it (:func:`~moe_runtime.hybrid.executor.split_ranges`): the host's pool
        read rate and sustained FLOP/s (:meth:`~moeserve.sim.hardware.HostProfile.pool_gbps`,
        ``pool_flops``), one core's (``CORE_READ_GBPS``, ``sustained_flops / cores``) per range,
        ``unit_overhead_us`` per range before the last, ``expert_overhead_us`` per expert."""
        from moeserve.sim.hardware import CORE_READ_GBPS

        h, i, nbytes, mats = (
            profile.hidden,
            profile.expert_intermediate,
            profile.expert_bytes,
            profile.expert_mats,
        )
        bw, fl = host.pool_gbps(threads) * 1e9, host.pool_flops(threads)
        core_bw, core_fl = CORE_READ_GBPS * 1e9, host.sustained_flops / host.cores
        flops = profile.expert_flops_per_token
        phases = []
        for rows, width, share in (((mats - 1) * i, i, (mats - 1) / mats), (h, h, 1 / mats)):
            n = len(split_ranges(rows, nbytes // (mats * width), threads, MIN_UNIT_BYTES))
            b, f = nbytes * share, flops * share
            phases.append(
                (b / bw, f / fl, (n - 1) * host.unit_overhead_us * 1e-6, b / n / core_bw, f / n / core_fl)
            )
        return cls(
            host.expert_overhead_us * 1e-6,
            nbytes / bw,
            flops / fl,
            f"the pool ({host.name}, {threads} threads on each expert)",
            tuple(phases),
        )

    @classmethod
    def measured(cls, per_expert_s: float, per_row_s: float, label: str = "measured") -> CPUCost:
        """A measured line ``per_expert_s + per_row_s x rows``."""
        return cls(per_expert_s, 0.0, per_row_s, label)

    def seconds(self, rows: int) -> float:
        if not self.phases:
            return self.overhead_s + max(self.bytes_s, self.flop_s_per_row * rows)
        return self.overhead_s + sum(
            max(b, f * rows, st + max(rb, rf * rows)) for b, f, st, rb, rf in self.phases
        )


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Hybrid execution settings of a simulation.

    Attributes:
        mode: ``device`` (every miss copied: the simulator as without hybrid execution), ``cpu``
            or ``auto`` (``--expert-compute``).
        threads: the CPU pool's threads (``--cpu-expert-threads``); the pool is one lane.
        cpu: one CPU expert's time. bound_miss_s: a missed expert's seconds in the hybrid bound
            (``bytes / (link + host bandwidth)``); bound_hit_s: a resident one's (its weights
            read from HBM); either None: no bound.
    """

    mode: str = "device"
    threads: int = 1
    cpu: CPUCost | None = None
    bound_miss_s: float | None = None
    bound_hit_s: float | None = None


class SimPlacer:
    """The runtime's :class:`~moe_runtime.hybrid.placement.HybridPlacer` on the event clock.

    Args:
        buffer: the :class:`~moeserve.sim.buffer.SimBuffer` it serves (its ``placer``).
        mode: ``cpu`` or ``auto``. lanes: CPU lanes (>= 1; the runtime's pool is 1). cpu: one
            CPU expert's time on a lane.
        device_s: seconds the device takes for one expert over ``rows`` rows.
        expert_bytes: bytes per expert (the copies a CPU expert avoids).
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
        ascending expert order, as the runtime's batch takes them); returns when the last ends."""
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
    order (``moe_runtime.hybrid.setup.fixed_keys``), once."""
    for part in buffer.parts:
        if part.key_slot:  # every expert homed here fitted: resident already
            continue
        part.preload(fixed_keys(buffer, part))


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
