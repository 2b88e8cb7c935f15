"""Where each missed expert of a layer runs: the cost model of hybrid expert execution.

Pure arithmetic on seconds and row counts (no threads, no clocks, no torch), so the runtime's
placement (:mod:`moe_runtime.hybrid.placement`) and a discrete-event simulator call the same code.

NOTE: the model. A layer's needed experts are *resident* (their slot is ready: they run on the
device), *in flight* (a copy is landing: wait for it, then the device) or *missed*. A miss either
crosses the link (``copy``: it lands after the link's backlog and the copies placed before it, then
the device runs it) or runs on the CPU from host memory (``cpu``, as Fiddler, KTransformers and
llama.cpp's ``--n-cpu-moe`` compute experts). Each resource is a lane with a finish time: one link
and one device lane per device partition, and the CPU lanes. The runtime has ONE CPU lane: its
pool splits each expert over every thread by output rows (as llama.cpp and KTransformers split a
matrix product over their threads), so its experts run one after another at the whole pool's rate
(at decode, the socket's memory bandwidth rather than one core's), and the CPU fit is the whole
pool's: measured at load with every thread on one expert, refitted from each layer run's experts.
``cpu_lanes`` > 1 models independent executors sharing nothing (each with the same fit); the
runtime and the simulator pass 1. Misses are placed
greedily by expected finish time (HybriMoE's intra-layer split, HybriMoE §4): most rows first (a
prefill chunk's busy experts, whose CPU time is compute-bound, meet the device first), each where
it would finish first, ties to the device. So the CPU side and the link side end together, and a
miss with many tokens goes to the device by the same rule as any other.

Times come from two :class:`LinearCost` fits, ``seconds = per_expert + per_row x rows``: the CPU
pool's (measured at load, then from the executor's own timings) and the device's (measured at
load; on a CPU device also from the compute thread's batches). The link's time per expert is the
I/O threads' own measure (``ExpertBuffer.copy_seconds``, the prefetch gate's ``t``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: weight of the past per new sample in a :class:`LinearCost` fit
DECAY = 0.97
#: a sample counts at most this factor above (or below) the fit's prediction: on a shared host a
#: preempted batch would otherwise pull the fit up for many samples
CLIP = 2.0


@dataclass
class LinearCost:
    """``seconds = per_expert_s x experts + per_row_s x rows``, refitted online.

    An exponentially weighted least-squares fit over ``(experts, rows, seconds)`` samples, each
    clipped to within :data:`CLIP` times the current prediction, with the load-time figures as a
    prior of fixed weight ``prior_weight`` at ``rows`` 1 and ``prior_rows``
    (so a run of decode samples, all at one row, moves the level but not the slope away from it).

    Args:
        per_expert_s: seconds per expert (reading its weights, launching its ops).
        per_row_s: seconds per token row (its FLOPs).
        prior_rows: the larger row count the prior speaks for (>= 2).
        prior_weight: the prior's weight in samples. decay: weight of the past per sample.
    """

    per_expert_s: float
    per_row_s: float
    prior_rows: int = 32
    prior_weight: float = 4.0
    decay: float = DECAY
    samples: int = 0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # cc, cr, rr, yc, yr (decayed)
    _prior: list[tuple[float, float, float]] = field(default_factory=list)  # (experts, rows, seconds)

    def __post_init__(self) -> None:
        self.reset_prior()

    def reset_prior(self) -> None:
        """Make the current line the prior (two points: 1 and :attr:`prior_rows` rows)."""
        self._prior = [(1.0, r, self.predict(r)) for r in (1.0, float(self.prior_rows))]

    def predict(self, rows: float, experts: float = 1.0) -> float:
        """Seconds for ``experts`` experts over ``rows`` token rows in all."""
        return self.per_expert_s * experts + self.per_row_s * rows

    def observe(self, experts: float, rows: float, seconds: float) -> None:
        """One measured batch: ``experts`` experts over ``rows`` rows took ``seconds``."""
        if experts <= 0 or seconds < 0:
            return
        want = self.predict(rows, experts)
        if want > 0:
            seconds = min(max(seconds, want / CLIP), want * CLIP)
        s, d = self._sums, self.decay
        for i, v in enumerate(
            (experts * experts, experts * rows, rows * rows, seconds * experts, seconds * rows)
        ):
            s[i] = d * s[i] + v
        self.samples += 1
        self._refit()

    def _refit(self) -> None:
        cc, cr, rr, yc, yr = self._sums
        w = self.prior_weight / 2
        for c, r, y in self._prior:
            cc, cr, rr, yc, yr = (
                cc + w * c * c,
                cr + w * c * r,
                rr + w * r * r,
                yc + w * y * c,
                yr + w * y * r,
            )
        det = cc * rr - cr * cr
        if det <= 1e-30 * max(cc * rr, 1e-300):
            return
        a = (yc * rr - yr * cr) / det
        b = (cc * yr - cr * yc) / det
        if b < 0:  # no negative cost per row: the level alone
            a, b = yc / cc, 0.0
        if a < 0:
            a, b = 0.0, yr / rr
        self.per_expert_s, self.per_row_s = a, b


@dataclass(frozen=True)
class LayerCosts:
    """The inputs of one layer's placement, all in seconds from the layer's start.

    Attributes:
        resident_rows: per device partition, the token rows of each resident expert (device).
        inflight_rows: per partition, the rows of each expert whose copy is landing.
        miss_rows: the rows of each missed expert; miss_part: its home partition.
        link_s: one expert's copy time per partition (the I/O threads' measure).
        link_backlog_s: per partition, link time still taken by copies in flight.
        cpu_lanes: independent CPU executors, each running one expert at a time (the runtime's
            pool, every thread on each expert, is 1); 0 = no CPU side.
        cpu_busy_s: per CPU lane, work still queued on it (usually 0 at a layer's start).
        cpu_start_s: seconds from the layer's start until a CPU lane can begin its first expert
            (the pool's wake-up and, on a host where the compute thread holds the interpreter
            lock, its wait for it); charged only where an expert is placed on the CPU.
    """

    resident_rows: Sequence[Sequence[int]]
    inflight_rows: Sequence[Sequence[int]]
    miss_rows: Sequence[int]
    miss_part: Sequence[int]
    link_s: Sequence[float]
    link_backlog_s: Sequence[float]
    cpu_lanes: int
    cpu_busy_s: Sequence[float] = ()
    cpu_start_s: float = 0.0


@dataclass(frozen=True)
class Placement:
    """One layer's placement of its misses.

    Attributes:
        on_cpu: per miss (the order of ``LayerCosts.miss_rows``), True = run on the CPU, False =
            copy it now and run it on the device.
        predicted_s: the layer's expected time, the last lane's finish.
        device_s: the device lanes' latest finish. cpu_s: the CPU lanes' latest finish.
    """

    on_cpu: tuple[bool, ...]
    predicted_s: float
    device_s: float
    cpu_s: float


def device_lanes(
    resident_rows: Sequence[Sequence[int]],
    inflight_rows: Sequence[Sequence[int]],
    link_backlog_s: Sequence[float],
    device: LinearCost,
) -> list[float]:
    """Per device partition, when its lane ends with no miss placed: its resident experts, then
    the in-flight ones as they land within the link's backlog (seconds from the layer's start)."""
    out = []
    for res, fly, backlog in zip(resident_rows, inflight_rows, link_backlog_s):
        t = device.predict(sum(res), len(res)) if res else 0.0  # a linear cost: the batch at once
        for r in fly:  # landing within the backlog, then the device runs them
            t = max(t, backlog) + device.predict(r)
        out.append(t)
    return out


def place_layer(costs: LayerCosts, cpu: LinearCost, device: LinearCost, mode: str = "auto") -> Placement:
    """Place a layer's misses (``mode`` ``auto``: greedy by expected finish time, HybriMoE's
    intra-layer split; ``cpu``: every miss on the CPU, llama.cpp's ``--n-cpu-moe``; ``device``:
    every miss copied) and predict the layer's time. Deterministic: the same inputs give the same
    placement (misses are taken by rows descending, then by their order in ``miss_rows``; a tie
    goes to the device).

    Raises:
        ValueError: an unknown ``mode``, or ``cpu`` with no CPU lane.
    """
    if mode not in ("auto", "cpu", "device"):
        raise ValueError(f"unknown placement mode {mode!r}")
    if mode == "cpu" and costs.cpu_lanes < 1:
        raise ValueError("placement mode cpu needs at least one CPU lane")
    dev_free = device_lanes(costs.resident_rows, costs.inflight_rows, costs.link_backlog_s, device)
    link_free = list(costs.link_backlog_s)
    lanes = list(costs.cpu_busy_s) or [0.0] * costs.cpu_lanes
    lanes = (lanes + [0.0] * costs.cpu_lanes)[: costs.cpu_lanes]
    on_cpu = [False] * len(costs.miss_rows)
    order = sorted(range(len(costs.miss_rows)), key=lambda i: (-costs.miss_rows[i], i))
    for i in order:
        rows, p = costs.miss_rows[i], costs.miss_part[i]
        land = link_free[p] + costs.link_s[p]
        dev_end = max(dev_free[p], land) + device.predict(rows)
        if lanes and mode != "device":
            lane = min(range(len(lanes)), key=lanes.__getitem__)
            cpu_end = max(lanes[lane], costs.cpu_start_s) + cpu.predict(rows)
            if mode == "cpu" or cpu_end < dev_end:
                lanes[lane] = cpu_end
                on_cpu[i] = True
                continue
        link_free[p], dev_free[p] = land, dev_end
    device_s = max(dev_free, default=0.0)
    cpu_s = max(lanes, default=0.0)
    return Placement(tuple(on_cpu), max(device_s, cpu_s), device_s, cpu_s)


def blocking_per_miss(link_wait_s: float, cpu_s: float | None) -> float:
    """What one avoided miss saves when misses may run on the CPU: the cheaper of waiting for its
    copy (``link_wait_s``, the prefetch gate's ``b``) and computing it on the CPU (``cpu_s``;
    None: no CPU side)."""
    return link_wait_s if cpu_s is None else min(link_wait_s, cpu_s)
