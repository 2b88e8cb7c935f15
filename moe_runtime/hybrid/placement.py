"""The runtime's placement of every needed expert of a layer: resident, in flight, copy now, or CPU.

:class:`HybridPlacer` is attached to an :class:`~moe_runtime.buffer.ExpertBuffer` (``placer``);
``start_layer`` calls :meth:`HybridPlacer.split` under the buffer's lock, before any lookup. It
sorts the layer's experts by their slot state (READY: resident; LOADING: in flight; else missed),
places the misses with :func:`~moe_runtime.hybrid.cost_model.place_layer` (``auto``: greedy by
expected finish time, HybriMoE's intra-layer split; ``cpu``: every miss on the CPU, llama.cpp's
``--n-cpu-moe``) and takes the CPU ones out of the lookup: they queue no copy, take no slot and
are not admitted to the buffer by this use (a queued prefetch of one is cancelled: it was for
this use). The rest is looked up as before (hits pinned, copies queued as demand).

The cost model's inputs are measured: the link's time per copy (each partition's running mean of
its I/O thread's timings, ``Partition.copy_s_mean``, before any copy a probe at load), the CPU
pool's time per expert (one lane: every pool thread works on each expert; the load-time fit of
the whole pool on one expert, then each layer run's experts, :attr:`CPUExpertExecutor.samples`)
and the device's (load-time probe; on a CPU device also each batch the compute thread runs).

Each layer run's predicted time (the lanes' last finish, plus :attr:`HybridPlacer.host_s`, the
running mean of the host time the lanes do not hold: routing's tail, planning, the batches' index
work) is kept beside its measured time (from the placement to the end of the MoE block's experts,
CPU outputs included: ``LayerRun.ended``) in :attr:`HybridPlacer.records`
(:meth:`HybridPlacer.prediction_error`); a record holds the prediction made before its run.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_runtime.buffer.slots import READY
from moe_runtime.hybrid.cost_model import CLIP, LayerCosts, LinearCost, device_lanes, place_layer
from moe_runtime.hybrid.executor import CPUExpertExecutor
from moe_runtime.hybrid.layer_share import CPUExperts

#: layer runs whose prediction and measurement are kept
RECORDS = 20000
#: weight of a new layer run in the running host time per layer (HybridPlacer.host_s)
HOST_DECAY = 0.05


@dataclass(frozen=True, slots=True)
class LayerRecord:
    """One layer run: its MoE layer, predicted and measured seconds, experts per placement."""

    layer: int
    predicted_s: float
    measured_s: float
    resident: int
    inflight: int
    cpu: int
    copied: int


class HybridPlacer:
    """Places each layer's misses on the CPU or the link (see the module note).

    Args:
        buffer: the expert buffer it serves. mode: ``auto`` or ``cpu``.
        executor: the CPU pool. cpu_cost / device_cost: per-expert cost fits (seconds).
        device_timed: the device's batches can be timed on the host (a CPU device): the
            compute thread's batches then refit ``device_cost`` when no CPU expert runs beside
            them, else :attr:`device_cost_shared` (on a CPU device both sides read the same
            memory, so the device runs slower while CPU experts run; elsewhere the two fits stay
            the load-time one).
        link_probe_s: per partition, one copy's seconds measured at load (used until the I/O
            thread has timed a copy).
    """

    def __init__(
        self,
        buffer: Any,
        mode: str,
        executor: CPUExpertExecutor,
        cpu_cost: LinearCost,
        device_cost: LinearCost,
        device_timed: bool,
        link_probe_s: list[float],
    ) -> None:
        if mode not in ("auto", "cpu"):
            raise ValueError(f"a placer runs auto or cpu, not {mode!r}")
        self.buffer, self.mode, self.executor = buffer, mode, executor
        self.cpu_cost, self.device_cost = cpu_cost, device_cost
        # the device while CPU experts run: its own fit where the device's batches are timed
        self.device_cost_shared = copy.deepcopy(device_cost) if device_timed else device_cost
        self._shared = False  # the running layer has CPU experts
        self.device_timed = device_timed
        self.link_probe_s = link_probe_s
        self.records: deque[LayerRecord] = deque(maxlen=RECORDS)
        self._pending: tuple[Any, float, int, float, tuple[int, int, int, int]] | None = None
        self._rows_of: dict[int, int] = {}  # the running layer's rows per needed expert (CPU device)
        self._batches = [0, 0, 0.0]  # the running layer run's device batches: experts, rows, seconds
        # the layer run's host time the lanes do not hold (routing's tail, planning, the batches'
        # index work, gathering the CPU outputs): a running mean of measured - lanes, added to
        # each prediction (the record keeps the prediction made before the run)
        self.host_s = 0.0
        self._cpu_rows = 1.0  # running mean rows per CPU expert (the gate's CPU time per miss)
        self.cpu_start_s = 0.0  # running mean of a CPU batch's submit to its first unit's start
        self._starts_seen = 0

    # ------------------------------------------------------------------ inputs
    def link_seconds(self, part: Any) -> float:
        """One copy's seconds on ``part``'s link: its I/O thread's running mean, else the probe."""
        m = part.copy_s_mean
        return self.link_probe_s[part.index] if m is None else m

    def _drain(self) -> None:
        """Fold the executor's finished CPU experts into the CPU cost fit."""
        samples = self.executor.samples
        while samples:
            rows, seconds = samples.popleft()
            self.cpu_cost.observe(1, rows, seconds)
            self._cpu_rows += HOST_DECAY * (rows - self._cpu_rows)
        starts = self.executor.start_samples
        while starts:
            w = 1.0 if self._starts_seen == 0 else HOST_DECAY
            self.cpu_start_s += w * (starts.popleft() - self.cpu_start_s)
            self._starts_seen += 1

    @property
    def cpu_miss_seconds(self) -> float | None:
        """Seconds the CPU takes for one miss at the usual rows per CPU expert (the prefetch gate's
        blocking per miss is at most this with hybrid execution on; ``cpu`` mode: None, it never
        prefetches)."""
        return self.cpu_cost.predict(self._cpu_rows) if self.mode == "auto" else None

    def time_batch(self, experts: list[int], seconds: float) -> None:
        """The compute thread ran ``experts`` of the running layer as one batch in ``seconds``
        (a CPU device): summed over the layer run, then one sample of the device fit (a linear
        cost: the run's batches add up to one), folded in at the next :meth:`split`."""
        if experts:
            acc = self._batches
            acc[0] += len(experts)
            acc[1] += sum(self._rows_of[e] for e in experts)
            acc[2] += seconds

    def _fold_batches(self) -> None:
        acc = self._batches
        if acc[0]:
            fit = self.device_cost_shared if self._shared else self.device_cost
            fit.observe(acc[0], acc[1], acc[2])
            acc[0] = acc[1] = acc[2] = 0

    # ------------------------------------------------------------------ the split
    def split(
        self, layer: int, experts: list[int], keys: list[int], counts: np.ndarray
    ) -> tuple[list[int], list[int], CPUExperts | None, float]:
        """Place the layer's ``experts`` (flat ``keys``; ``counts [E]`` token rows per expert);
        returns the experts and keys left for the lookup (resident, in flight, copy now), the CPU
        share (or None) and the placement's predicted seconds. Caller holds the buffer's lock.
        A layer with no miss skips the greedy (nothing to place): its lanes are the device's."""
        now = time.perf_counter()
        if self._pending is not None:
            self._record()
        if self._batches[0]:
            self._fold_batches()
        ex = self.executor
        if ex.samples or ex.start_samples:
            self._drain()
        buf = self.buffer
        parts, home = buf.parts, buf._home
        n_parts = len(parts)
        resident: list[list[int]] = [[] for _ in range(n_parts)]
        inflight: list[list[int]] = [[] for _ in range(n_parts)]
        miss: list[int] = []
        rows = counts[experts].tolist()  # one numpy op, not one per expert
        for i, key in enumerate(keys):
            d = home[key]
            part = parts[d]
            s = part.key_slot.get(key)
            if s is None:
                miss.append(i)
            elif part.state[s] == READY:
                resident[d].append(rows[i])
            else:
                inflight[d].append(rows[i])
        if self.device_timed:
            self._rows_of = dict(zip(experts, rows))
        n_res = sum(map(len, resident))
        n_fly = sum(map(len, inflight))
        link_s = [self.link_seconds(p) for p in parts]
        backlog = [p.loading * t for p, t in zip(parts, link_s)]
        if not miss:  # nothing to place: the lanes are the device's
            self._shared = False
            predicted = max(device_lanes(resident, inflight, backlog, self.device_cost)) + self.host_s
            self._pending = (None, now, layer, predicted, (n_res, n_fly, 0, 0))
            return experts, keys, None, predicted
        costs = LayerCosts(
            resident,
            inflight,
            [rows[i] for i in miss],
            [home[keys[i]] for i in miss],
            link_s,
            backlog,
            1,  # the pool: every thread on one expert at a time, one lane
            cpu_start_s=self.cpu_start_s,
        )
        # the device's time as it runs beside CPU experts; with none placed, as it runs alone (one
        # call where they cannot differ: one fit for both)
        if self.device_cost_shared is self.device_cost:
            placed = place_layer(costs, self.cpu_cost, self.device_cost, self.mode)
        else:
            placed = place_layer(costs, self.cpu_cost, self.device_cost_shared, self.mode)
            if not any(placed.on_cpu):
                alone = place_layer(costs, self.cpu_cost, self.device_cost, self.mode)
                placed = alone if not any(alone.on_cpu) else placed
        self._shared = any(placed.on_cpu)
        on_cpu = {miss[j] for j, c in enumerate(placed.on_cpu) if c}
        cpu = None
        if on_cpu:
            st = buf.stats
            cpu_experts = [experts[i] for i in sorted(on_cpu)]
            for i in on_cpu:
                key = keys[i]
                part = parts[home[key]]
                if part.queue.cancel(key) is not None:  # its prefetch was for this use
                    st.prefetch_cancelled += 1
                st.device_lookups[part.index] += 1
            n = len(on_cpu)
            st.lookups[layer] += n
            st.cpu_experts[layer] += n
            st.cpu_avoided_bytes += n * buf.store.expert_nbytes
            experts = [e for i, e in enumerate(experts) if i not in on_cpu]
            keys = [k for i, k in enumerate(keys) if i not in on_cpu]
            cpu = CPUExperts(ex, layer, cpu_experts, buf.num_experts, st)
        placement = (n_res, n_fly, len(on_cpu), len(miss) - len(on_cpu))
        predicted = placed.predicted_s + self.host_s
        self._pending = (None, now, layer, predicted, placement)
        return experts, keys, cpu, predicted

    def bind(self, run: Any) -> None:
        """The layer run the last :meth:`split` made: its end is measured (``run.ended``)."""
        run.timed = True
        if self._pending is not None:
            self._pending = (run, *self._pending[1:])
        if self.device_timed:
            run.timer = self.time_batch

    def _record(self) -> None:
        """Keep the last layer run's prediction beside its measured time."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is None:
            return
        run, t0, layer, predicted, (res, fly, n_cpu, copied) = pending
        if run.ended > t0:
            measured = run.ended - t0
            self.records.append(LayerRecord(layer, predicted, measured, res, fly, n_cpu, copied))
            lanes = predicted - self.host_s
            extra = min(measured - lanes, CLIP * max(self.host_s, 0.1 * lanes))  # a preempted run: clipped
            self.host_s = max(0.0, self.host_s + HOST_DECAY * (extra - self.host_s))

    # ------------------------------------------------------------------ figures
    def prediction_error(self, last: int | None = None, min_misses: int = 0) -> float | None:
        """Median of ``|predicted - measured| / measured`` over the kept layer runs (the last
        ``last``; only runs with at least ``min_misses`` misses), or None without any."""
        self._record()
        recs = [r for r in self.records if r.cpu + r.copied >= min_misses and r.measured_s > 0]
        if last is not None:
            recs = recs[-last:]
        if not recs:
            return None
        return statistics.median(abs(r.predicted_s - r.measured_s) / r.measured_s for r in recs)

    def describe(self) -> str:
        """The summary's words: mode, threads, kernel and its measured GB/s (the whole pool on one
        expert), link time, and any kernel the pool runs whole (its ranges differed in bits)."""
        link = ", ".join(f"{1e3 * self.link_seconds(p):.2f}" for p in self.buffer.parts)
        ex = self.executor
        n = ex.threads
        whole = f"; not split: {', '.join(sorted(ex.whole))}" if ex.whole else ""
        return (
            f"expert compute {self.mode}: {n} CPU expert thread{'s' if n > 1 else ''}, "
            f"kernel {ex.choice.describe()}, copy {link} ms per expert{whole}"
        )

    def close(self) -> None:
        self.executor.close()
