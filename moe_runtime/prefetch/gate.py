"""The cost gate (ours, not in MoE-Infinity): issue a prefetch only when its expected gain beats
its expected cost.

The ``eam`` plan (MoE-Infinity §5.1, :mod:`moe_runtime.prefetch.eam`) hands over its candidates
best first; the gate keeps the ones that pay. The policy's side of it (when to plan, the plan's
host time, the step's link terms, the one compiled call per plan) is
:mod:`moe_runtime.prefetch.gating`; the kernels are :mod:`moe_runtime.prefetch.gate_kernels`.

NOTE: the terms, all measured online, none typed in:

* ``P``: the chance a candidate is used. Every plan's candidates are ranked per later layer by the
  predictor's probability; when that layer routes, each ranked candidate is checked against the
  experts it really used, and a running (exponentially decayed) precision is kept per layer
  distance ``d`` and rank ``r``: ``P = hits[d, r] / trials[d, r]``. Candidates are judged whether
  or not they were issued, so the estimate never starves.
* gain ``= P * b * (1 - q)``: ``b`` is the blocking one avoided demand fetch saves, the running
  mean of the buffer's blocking seconds per miss (before any miss: one copy's link time). A right
  prefetch saves it only out of link time demand fetches leave idle: on a link the demand copies
  keep busy (share ``q``) the copy merely moves ahead of a demand copy that then waits instead.
  With hybrid execution (``moe_runtime.hybrid``, runtime only) a miss may run on the CPU instead
  of waiting for its copy, so ``b`` is the cheaper of the two: ``min(b, CPU seconds per miss)``
  (:meth:`PrefetchGate.miss_cost_s`; ``ExpertBuffer.cpu_miss_seconds``, read at a step's end).
* cost ``= (1 - P) * q * t + R * b + h``: a wrong prefetch holds the link for one copy's time ``t``
  (the I/O threads' own timing of their copies, ``ExpertBuffer.copy_seconds``: copy-stream events
  on CUDA; the simulator's link time there), which demand fetches queue behind with the chance
  ``q`` that the link is busy with demand (the running share of time the demand copies take); and
  it evicts a resident expert that is used again in the next step with probability ``R`` (no
  eviction while slots are free). ``R`` comes from the running requests' request EAMs, as the
  ``eam-reuse`` cache scores slots: ``p = 1 - (1 - share)^T``, the victims taken lowest first.
  ``h`` (runtime only, 0 in the simulator): the compute thread's time each copy takes from it
  whether used or not, the I/O thread's own work per copy (picking it, its slot's victim,
  landing it: Python that holds the GIL, ``ExpertBuffer.copy_host_seconds``, the I/O threads'
  running mean of their CPU time per copy outside the copy and the link's wait). A prefetch
  overlaps the compute thread's work, so that work waits for the GIL; a demand copy runs while
  the compute thread blocks, so it does not (bundled model, 10% buffer, 0.5 GB/s, prefetching
  pinned on: 1-3 ms of a 20-28 ms decode step; ``moe_runtime.prefetch.run_clock``).

* The plan's own host time (runtime only): the compute thread's CPU seconds that planning a
  layer and computing its router lookahead take (thread CPU time, so other processes preempting
  it on a shared host do not inflate it), measured by the ``eam`` policy (a running mean over
  the decode layers that plan; a prefill layer's plan, which ranks a whole prompt's routing and
  ran first and cold, took 8.4 ms against a decode plan's 0.26 ms p50 on the bundled model, and
  alone kept the mean several times too high for a whole ``bench policies`` run; each sample is
  clipped at :data:`HOST_CLIP` times the mean, and the mean fades by :data:`HOST_FORGET` per
  decode step without plans, so a figure measured under a passing load does not bar
  prefetching for good). By the time a plan is tested its host time is spent, so the candidates
  that pay are issued whatever it was; but while a plan's summed ``gain - cost`` does not beat
  it (a fast link, or prefetches that save less blocking than planning costs), the policy stops
  planning every layer and only probes (``EAMPrefetch.probe_every``): it is on-demand. The
  simulator's clock is not the host's: there it is 0, so its results stay deterministic.
* Idle link time: the link time a step's demand copies leave idle (the step's duration less
  ``demand copies x t``), in copies per planning layer (:attr:`PrefetchGate.idle_copies`, a
  running mean). The plan's best candidates up to that many are copied while the link would
  otherwise idle: no demand copy queues behind them, and a right one saves a whole miss, so
  their test is gain ``P * b`` against cost ``R * b`` (no ``q`` terms). Where demand copies keep
  the link busy (the simulator's A5000 profile: one Mixtral expert takes 14 ms) it is 0.

So with poor predictions (``P`` low), a link the demand fetches keep busy (``q`` near 1), a fast
link (``b`` near 0 against a measurable ``q``) or a
buffer full of experts the batch keeps using (``R`` high), no candidate pays and the policy is
on-demand; and a plan that keeps nothing cancels what it queued before.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import moe_runtime.prefetch.gate_kernels as gate_kernels

# Weight of the past in the per-step link figures (b, q): they follow the load within a few steps.
LINK_DECAY = 0.8
# A planning layer's host time counts at most this many times the running mean (a cold or
# preempted plan moves the mean by at most (HOST_CLIP - 1) x (1 - LINK_DECAY) of itself).
HOST_CLIP = 4.0
# Factor on the running host time per decode step without plans (PrefetchGate.forget_host_time):
# half-life of about 350 steps, after which the measured trial may try prefetching again and time
# fresh plans. Each such try costs a window of plans: at 0.99 (half-life 69) the bundled model
# without a link re-tried every few hundred decode steps, 11 steps of plans each time.
HOST_FORGET = 0.998


class PrefetchGate:
    """Online precision by (layer distance, rank), link and blocking terms, and the gain/cost test.

    Args:
        num_layers, num_experts: ``L``, ``E``.
        depth: the farthest layer distance a plan covers (>= 1).
        decay: weight of the past per new observation in the running figures, in ``(0, 1]``.
        prior: ``(hits, trials)`` each (distance, rank) cell starts with (precision 0.5 by default,
            worth two observations).
        force_open: issue every candidate whatever the test says (the test still runs; ``bench
            overhead`` times a planning layer this way).

    Raises:
        ValueError: ``depth < 1`` or ``decay`` outside ``(0, 1]``.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        depth: int,
        decay: float = 0.98,
        prior: tuple[float, float] = (1.0, 2.0),
        force_open: bool = False,
    ) -> None:
        if depth < 1:
            raise ValueError(f"gate depth must be >= 1, got {depth}")
        if not 0 < decay <= 1:
            raise ValueError(f"gate decay must be in (0, 1], got {decay}")
        self.num_layers, self.num_experts, self.depth, self.decay = num_layers, num_experts, depth, decay
        # [3, D, rank]: hits, trials and their ratio, kept current by observe (gate_kernels.score_noted)
        self._figures = np.empty((3, depth, num_experts))
        self.hits, self.trials, self._precision = self._figures
        self.hits[:], self.trials[:] = float(prior[0]), float(prior[1])
        self._precision[:] = self.hits / self.trials
        # the candidates noted for each layer and distance (experts, ranks; int32: a plan of every
        # later layer, the paper's, keeps L x L x 2 x E of them) and their count, until the layer
        # routes (gate_kernels.note_candidates / score_noted)
        self._noted = np.zeros((num_layers, depth, 2, num_experts), dtype=np.int32)
        self._noted_n = np.zeros((num_layers, depth), dtype=np.int64)
        self.block_per_miss_s: float | None = None  # b
        self.demand_busy = 1.0  # q: assume a busy link until measured
        self.idle_copies = 0.0  # copies that fit in the link's idle time per planning layer
        self.block_per_layer_s = 0.0  # running blocking per layer and step
        self.checked = 0  # candidates checked against routing so far
        self.host_s = 0.0  # running host seconds of one planning layer (runtime only; 0 = not timed)
        self.copy_host_s = 0.0  # h: the compute thread's seconds per copy's I/O work (runtime only)
        # with hybrid execution (moe_runtime.hybrid, runtime only) a miss may run on the CPU
        # instead: the CPU's seconds per miss caps b (None: every miss is copied)
        self.cpu_miss_s: float | None = None
        self.force_open = force_open
        self._last: tuple[float, float, int, int] | None = None  # (clock, blocking, misses, demand)

    # ------------------------------------------------------------------ precision
    def precision(self) -> np.ndarray:
        """``[D, E]`` running precision by layer distance (row ``d - 1``) and rank (column);
        read-only for callers (updated in place as :meth:`observe` scores candidates)."""
        return self._precision

    def note(self, distance0: int, first_layer: int, cand: np.ndarray) -> None:
        """Remember a plan's candidates for checking when their layers route: ``cand [3, n]``
        (int64 rows ``r``, ``c``, ``rank``, as ``gate_kernels.gate_plan`` returns them); entry ``i``
        is expert ``c[i]`` of layer ``first_layer + r[i]``, ranked ``rank[i]`` by the predictor
        in its layer's row, ``distance0 + r[i]`` layers ahead of the routed one
        (``gate_kernels.note_candidates``; the runtime's plans note inside ``gate_kernels.limit_gate_plan``).

        Pass only candidates a prefetch would copy (not resident or loading): they are used less
        often than the predictor's resident picks, and their precision is the one that matters.
        """
        cand = np.ascontiguousarray(cand, dtype=np.int64)
        gate_kernels.note_candidates(
            self._noted, self._noted_n, cand[0], cand[1], cand[2], first_layer, distance0
        )

    def observe(self, layer: int, topk_ids: np.ndarray) -> None:
        """Layer ``layer`` routed ``topk_ids [T, k]``: score the candidates noted for it
        (``gate_kernels.score_noted``)."""
        self.checked += gate_kernels.score_noted(
            self._figures, self._noted, self._noted_n, layer, routed_ids(topk_ids), self.decay
        )

    def plan_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(figures [3, D, E], noted [L, D, 2, E], noted_n [L, D])``: the arrays
        ``gate_kernels.limit_gate_plan`` scores and notes in place (the plan adds what it scored to
        :attr:`checked`)."""
        return self._figures, self._noted, self._noted_n

    def new_step(self) -> None:
        """Plans of the finished step that were never checked are dropped."""
        self._noted_n[:] = 0

    # ------------------------------------------------------------------ link and blocking
    def update_link(self, stats: Any, clock_s: float, transfer_s: float) -> None:
        """Refresh ``b`` and ``q`` from the buffer's counters (``ExpertStats``) at a step's end;
        ``clock_s`` is the compute side's clock (simulated or wall seconds), ``transfer_s`` one
        copy's link time."""
        blocking = stats.total_blocking_s
        demand = sum(stats.demand_fetches)
        misses = demand + sum(stats.late_prefetches)
        last, self._last = self._last, (clock_s, blocking, misses, demand)
        if last is None:
            return
        dt, db, dm, dd = clock_s - last[0], blocking - last[1], misses - last[2], demand - last[3]
        keep = LINK_DECAY
        self.block_per_layer_s = keep * self.block_per_layer_s + (1 - keep) * db / self.num_layers
        if dm > 0:
            b = db / dm
            old = self.block_per_miss_s
            self.block_per_miss_s = b if old is None else keep * old + (1 - keep) * b
        if dt > 0:
            self.demand_busy = keep * self.demand_busy + (1 - keep) * min(1.0, dd * transfer_s / dt)
            if transfer_s > 0:
                # the step's link time demand copies left idle, in copies per planning layer
                idle = max(0.0, dt - dd * transfer_s) / (transfer_s * max(1, self.num_layers - 1))
                self.idle_copies = keep * self.idle_copies + (1 - keep) * idle

    # ------------------------------------------------------------------ the test
    def pays(
        self,
        p_used: np.ndarray,
        transfer_s: float,
        reuse: np.ndarray,
    ) -> tuple[np.ndarray, bool]:
        """``([n] bool, plan on)``: the candidates (best first) whose gain beats their cost, and
        whether their summed ``gain - cost`` beats the plan's host time (:meth:`plans_pay`).

        Args:
            p_used: ``[n]`` chance each is used (from :meth:`precision`).
            transfer_s: one copy's link time ``t``.
            reuse: ``[n]`` chance the expert each one would evict is used in the next step (0: a
                free slot).

        The first ``int(idle_copies)`` are tested as copies in idle link time (no ``q`` terms).
        """
        b = self.miss_cost_s(transfer_s)
        p_used = np.ascontiguousarray(p_used, dtype=np.float64)
        reuse = np.ascontiguousarray(reuse, dtype=np.float64)
        idle = np.arange(p_used.size) < int(self.idle_copies)
        keep, net = gate_kernels.pays(
            p_used, b, self.demand_busy, transfer_s, reuse, self.force_open, idle, self.idle_save(transfer_s),
            self.copy_host_s,
        )  # fmt: skip
        return keep, self.plans_pay(net)

    def idle_save(self, transfer_s: float) -> float:
        """Seconds a right prefetch copied in idle link time saves: the next layer's demand
        copies run one fewer, so its wait shortens by up to one copy's time ``t``, as far as the
        layer blocks at all (:attr:`block_per_layer_s`); at least ``b``, the mean blocking per miss."""
        b = self.miss_cost_s(transfer_s)
        save = min(transfer_s, self.block_per_layer_s)
        return max(b, save if self.cpu_miss_s is None else min(save, self.cpu_miss_s))

    def miss_cost_s(self, transfer_s: float) -> float:
        """``b``, what one avoided miss saves: the running blocking per miss (before any, one
        copy's link time ``transfer_s``); with hybrid execution no more than the CPU's time for
        it, the cheaper of copying and computing on the CPU (``moe_runtime.hybrid``)."""
        b = transfer_s if self.block_per_miss_s is None else self.block_per_miss_s
        return b if self.cpu_miss_s is None else min(b, self.cpu_miss_s)

    def plans_pay(self, net_s: float) -> bool:
        """Whether a plan whose paying candidates save ``net_s`` seconds (summed ``gain - cost``)
        is worth planning every layer for: ``net_s`` beats the plan's host time :attr:`host_s`
        (> 0 in the simulator, where it is 0), or the gate is forced open."""
        return self.force_open or net_s > self.host_s

    def note_host_time(self, seconds: float) -> None:
        """A decode layer's plan cost the compute thread ``seconds`` (planning and router
        lookahead; measured by the runtime's policy, never by the simulator): updates
        :attr:`host_s`, the sample clipped at :data:`HOST_CLIP` times it."""
        if self.host_s == 0:
            self.host_s = seconds
            return
        seconds = min(seconds, HOST_CLIP * self.host_s)
        self.host_s = LINK_DECAY * self.host_s + (1 - LINK_DECAY) * seconds

    def forget_host_time(self) -> None:
        """A decode step ran without plans: :attr:`host_s` fades by :data:`HOST_FORGET` (it is
        not re-measured while nothing plans, and the host's speed drifts)."""
        self.host_s *= HOST_FORGET


def routed_ids(topk_ids: np.ndarray) -> np.ndarray:
    """``topk_ids [T, k]`` as the kernels take a layer's routing: C-contiguous int64 (itself
    when it already is, as the runtime's and the simulator's are)."""
    if topk_ids.dtype != np.int64 or not topk_ids.flags.c_contiguous:
        topk_ids = np.ascontiguousarray(topk_ids, dtype=np.int64)
    return topk_ids.reshape(len(topk_ids), -1) if topk_ids.ndim != 2 else topk_ids


def clock(buffer: Any) -> float:
    """The compute side's clock: the simulator's ``now``, else wall time."""
    now = getattr(buffer, "now", None)
    return time.perf_counter() if now is None else float(now)
