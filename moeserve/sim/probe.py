"""Timing probes on the runtime for calibration: wrap, from the outside, the methods whose timing the
simulator's cost model stands for, while the unchanged runtime (``bench policies``) runs.

:class:`RuntimeProbe` temporarily wraps ``ExpertBuffer.start_layer`` (one record per MoE layer:
start and end of its expert phase, i.e. of iterating the layer run, experts, blocking seconds),
``MoEModel.forward`` (one record per step: start, end, tokens), ``LinkModel.hold`` (seconds
from a copy's start until the emulated link released it) and, with hybrid expert execution,
``CPUExperts.finish`` (the compute thread's wait for a layer's CPU experts, and each CPU expert's
rows and seconds: its share of the pool's batch), keyed by buffer so each policy run of the
benchmark can be analysed on its own. Nothing in the runtime changes; the wrappers are removed on
exit.

:func:`costs_from_records` turns one run's records into the simulator's cost parameters: the
expert phase of a layer minus its blocking is fitted as ``c + a * experts + b * token-choices``;
the gap between consecutive layers up to the lookup (attention, router, tracer, cache-policy hook;
less the wait for CPU experts, which the simulator models itself) as ``d0 + d1 * tokens``; the CPU
jobs as ``a + b * rows``; from the lookup to the first expert (the prefetch plan) as its mean;
the rest of a step (embedding, LM head, sampling, scheduling) as a constant.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class RunRecords:
    """Records of one buffer (one policy run): layers ``(looked_up, t0, t1, experts, blocked_s)``
    (``looked_up``: ``start_layer`` called; ``t0 .. t1``: the expert phase; ``experts``: those the
    device computes), forwards ``(t0, t1, tokens)``, link holds ``(started, released)``; with
    hybrid execution the compute thread's waits for CPU experts ``(started, ended)`` and the CPU
    jobs ``(rows, seconds)``."""

    layers: list[tuple[float, float, float, int, float]] = field(default_factory=list)
    forwards: list[tuple[float, float, int]] = field(default_factory=list)
    holds: list[tuple[float, float]] = field(default_factory=list)
    cpu_waits: list[tuple[float, float]] = field(default_factory=list)
    cpu_jobs: list[tuple[int, float]] = field(default_factory=list)


class RuntimeProbe:
    """Context manager; ``runs`` lists one :class:`RunRecords` per ``ExpertBuffer`` in creation order."""

    def __init__(self) -> None:
        self.runs: list[RunRecords] = []
        self._by_buffer: dict[int, RunRecords] = {}
        self._by_stats: dict[int, RunRecords] = {}  # a buffer's ExpertStats -> its records (CPU jobs)
        self._keep: list[Any] = []  # keeps buffers alive so ids are not reused
        self._saved: list[tuple[Any, str, Any]] = []

    def _records(self, buffer: Any) -> RunRecords:
        rec = self._by_buffer.get(id(buffer))
        if rec is None:
            rec = self._by_buffer[id(buffer)] = RunRecords()
            self.runs.append(rec)
            self._keep.append(buffer)
        return rec

    def __enter__(self) -> RuntimeProbe:
        from moe_runtime.buffer.expert_buffer import ExpertBuffer
        from moe_runtime.hybrid.layer_share import CPUExperts
        from moe_runtime.io.link import LinkModel
        from moe_runtime.model import MoEModel

        probe = self
        start_layer, forward, hold = ExpertBuffer.start_layer, MoEModel.forward, LinkModel.hold
        finish = CPUExperts.finish
        links: dict[int, RunRecords] = {}

        def timed_start_layer(buf: Any, layer: int, experts: list[int], counts: Any = None) -> _TimedRun:
            rec = probe._records(buf)
            for part in buf.parts:
                if part.link is not None:
                    links[id(part.link)] = rec
            probe._by_stats[id(buf.stats)] = rec
            looked_up = time.perf_counter()
            run = start_layer(buf, layer, experts, counts)  # counts: rows per expert (hybrid placement)
            cpu = getattr(run, "cpu", None)
            on_device = len(experts) - (len(cpu.experts) if cpu is not None else 0)
            return _TimedRun(run, buf, rec, on_device, looked_up)

        def timed_forward(model: Any, input_ids: Any, step: Any) -> Any:
            t0 = time.perf_counter()
            out = forward(model, input_ids, step)
            probe._records(model.buffer).forwards.append((t0, time.perf_counter(), int(input_ids.shape[0])))
            return out

        def timed_hold(link: Any, nbytes: int, started: float, ready_at: float | None = None) -> None:
            hold(link, nbytes, started, ready_at)
            rec = links.get(id(link))
            if rec is not None:
                rec.holds.append((started, time.perf_counter()))

        def timed_finish(cpu: Any, x: Any, weights: Any) -> Any:
            rows = [(e, len(pos)) for e, _, pos in cpu.places]
            t0 = time.perf_counter()
            out = finish(cpu, x, weights)
            rec = probe._by_stats.get(id(cpu.stats))
            if rec is not None:
                rec.cpu_waits.append((t0, time.perf_counter()))
                rec.cpu_jobs += [(n, cpu.seconds[e]) for e, n in rows]
            return out

        for cls, name, fn in (
            (ExpertBuffer, "start_layer", timed_start_layer),
            (MoEModel, "forward", timed_forward),
            (LinkModel, "hold", timed_hold),
            (CPUExperts, "finish", timed_finish),
        ):
            self._saved.append((cls, name, getattr(cls, name)))
            setattr(cls, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)
        self._saved.clear()
        self._keep.clear()
        self._by_stats.clear()


class _TimedRun:
    """A layer run that records its expert phase (first handle requested .. last one used)."""

    def __init__(self, run: Any, buf: Any, rec: RunRecords, experts: int, looked_up: float) -> None:
        self.run, self.buf, self.rec, self.experts, self.looked_up = run, buf, rec, experts, looked_up

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)  # the run's other attributes (``cpu``, ``resident_first``)

    def __iter__(self) -> Iterator[Any]:
        return self._timed(iter(self.run))

    def batches(self) -> Iterator[Any]:
        return self._timed(self.run.batches())

    def _timed(self, items: Iterator[Any]) -> Iterator[Any]:
        b0 = self.buf.stats.total_blocking_s
        t0 = time.perf_counter()
        yield from items
        blocked = self.buf.stats.total_blocking_s - b0
        self.rec.layers.append((self.looked_up, t0, time.perf_counter(), self.experts, blocked))

    def close(self) -> None:
        self.run.close()


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``y ~ x @ coef`` with every coefficient >= 0 (a negative cost is noise:
    columns whose coefficient comes out negative are dropped and the rest refitted). No outlier
    trimming: on a busy host the long tail (the thread preempted, the GIL held elsewhere) is real
    time the runtime spent, and blocking and TPOT are means."""
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while active.any():
        sub = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (sub >= 0).all():
            coef[active] = sub
            break
        active[np.flatnonzero(active)[sub < 0]] = False
    return coef


@dataclass(slots=True)
class Costs:
    """Cost parameters in seconds (see :meth:`moeserve.sim.cost.CostModel.measured`)."""

    expert_a_s: float
    expert_b_s: float
    layer_a_s: float
    layer_b_s: float
    step_s: float
    transfer_s: float | None
    io_gap_s: float | None = None
    plan_s: float = 0.0  # from the lookup to the first expert: the prefetch plan, the gather
    layer_jitter_s: float = 0.0  # robust std of the gaps between layers around their fit
    cpu_a_s: float | None = None  # a CPU job (hybrid execution): a + b * rows; None: no job ran
    cpu_b_s: float | None = None


def costs_from_records(rec: RunRecords, num_layers: int, top_k: int) -> Costs:
    """Fit one run's non-blocking times (see the module note). ``transfer_s`` is the mean link
    hold and ``io_gap_s`` the median gap between back-to-back copies (the I/O thread landing one
    and starting the next), or None when the run had no emulated link; ``layer_jitter_s`` is the
    spread of the gaps between layers around their fit (robust std)."""
    fwd = sorted(rec.forwards)
    layers = sorted(rec.layers)
    starts = np.asarray([f[0] for f in fwd])
    idx = np.searchsorted(starts, [lay[0] for lay in layers], side="right") - 1  # forward of each layer
    tokens = np.asarray([fwd[i][2] for i in idx], dtype=np.float64)
    lay = np.asarray(layers, dtype=np.float64)  # [n, (looked_up, t0, t1, experts, blocked)]
    busy = lay[:, 2] - lay[:, 1] - lay[:, 4]
    c, a, b = _fit(np.column_stack([np.ones(len(lay)), lay[:, 3], tokens * top_k]), busy)
    plan_s = float(np.mean(lay[:, 1] - lay[:, 0])) if len(lay) else 0.0
    gaps, gap_tokens, step_rest = [], [], []
    gap_iv, rest_iv = [], []  # the (start, end) of each gap and step rest
    for i, (f0, _, n) in enumerate(fwd):
        sel = np.flatnonzero(idx == i)
        if len(sel) != num_layers:
            continue
        prev_end = f0
        for j in sel:
            gaps.append(lay[j, 0] - prev_end)
            gap_iv.append((prev_end, lay[j, 0]))
            gap_tokens.append(n)
            prev_end = lay[j, 2]
        if i + 1 < len(fwd):
            period = fwd[i + 1][0] - f0
            step_rest.append(period - (prev_end - f0))
            rest_iv.append((prev_end, fwd[i + 1][0]))
    if rec.cpu_waits:  # the waits for CPU experts are the simulator's to model, not dense time
        gaps = list(np.asarray(gaps) - _waited(gap_iv, rec.cpu_waits))
        step_rest = list(np.asarray(step_rest) - _waited(rest_iv, rec.cpu_waits))
    d0, d1 = _fit(np.column_stack([np.ones(len(gaps)), gap_tokens]), np.asarray(gaps))
    # timing noise of a layer: 1.4826 x the median absolute deviation of the gaps around the fit
    # (a normal's std, not inflated by the rare preemption that a plain std would count)
    resid = np.asarray(gaps) - (d0 + d1 * np.asarray(gap_tokens, dtype=np.float64))
    jitter = float(1.4826 * np.median(np.abs(resid - np.median(resid)))) if len(gaps) > 1 else 0.0
    step_s = float(np.mean(step_rest)) if step_rest else 0.0
    transfer = io_gap = None
    if rec.holds:
        holds = sorted(rec.holds)
        transfer = float(np.mean([end - start for start, end in holds]))
        gaps = np.asarray([b[0] - a[1] for a, b in zip(holds, holds[1:])])
        back_to_back = gaps[(gaps >= 0) & (gaps < 0.5 * transfer)]  # the next copy was already queued
        io_gap = float(np.median(back_to_back)) if back_to_back.size else None
    cpu_a = cpu_b = None
    if rec.cpu_jobs:
        jobs = np.asarray(rec.cpu_jobs, dtype=np.float64)
        cpu_a, cpu_b = (float(v) for v in _fit(np.column_stack([np.ones(len(jobs)), jobs[:, 0]]), jobs[:, 1]))
    return Costs(
        float(a), float(b), float(d0 + c), float(d1), step_s, transfer, io_gap, plan_s, jitter, cpu_a, cpu_b
    )


def _waited(intervals: list[tuple[float, float]], waits: list[tuple[float, float]]) -> np.ndarray:
    """Per ``(start, end)`` interval, the seconds of the ``waits`` that began inside it."""
    w = np.asarray(sorted(waits), dtype=np.float64)
    total = np.concatenate([[0.0], np.cumsum(w[:, 1] - w[:, 0])])
    iv = np.asarray(intervals, dtype=np.float64).reshape(-1, 2)
    lo, hi = np.searchsorted(w[:, 0], iv[:, 0]), np.searchsorted(w[:, 0], iv[:, 1])
    return total[hi] - total[lo]
