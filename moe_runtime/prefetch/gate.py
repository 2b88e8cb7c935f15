"""Cost-aware prefetching: issue a prefetch only when its expected gain beats its expected cost.

NOTE: the terms (issue #15), all measured online, none typed in:

* ``P``: the chance a candidate is used. Every plan's candidates are ranked per later layer by the
  predictor's probability; when that layer routes, each ranked candidate is checked against the
  experts it really used, and a running (exponentially decayed) precision is kept per layer
  distance ``d`` and rank ``r``: ``P = hits[d, r] / trials[d, r]``. Candidates are judged whether
  or not they were issued, so the estimate never starves.
* gain ``= P * b * (1 - q)``: ``b`` is the blocking one avoided demand fetch saves, the running
  mean of the buffer's blocking seconds per miss (before any miss: one copy's link time). A right
  prefetch saves it only out of link time demand fetches leave idle: on a link the demand copies
  keep busy (share ``q``) the copy merely moves ahead of a demand copy that then waits instead.
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

from moe_runtime.prefetch import kernels

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
        # [3, D, rank]: hits, trials and their ratio, kept current by observe (kernels.score_noted)
        self._figures = np.empty((3, depth, num_experts))
        self.hits, self.trials, self._precision = self._figures
        self.hits[:], self.trials[:] = float(prior[0]), float(prior[1])
        self._precision[:] = self.hits / self.trials
        # the candidates noted for each layer and distance (experts, ranks; int32: a plan of every
        # later layer, the paper's, keeps L x L x 2 x E of them) and their count, until the layer
        # routes (kernels.note_candidates / score_noted)
        self._noted = np.zeros((num_layers, depth, 2, num_experts), dtype=np.int32)
        self._noted_n = np.zeros((num_layers, depth), dtype=np.int64)
        self.block_per_miss_s: float | None = None  # b
        self.demand_busy = 1.0  # q: assume a busy link until measured
        self.idle_copies = 0.0  # copies that fit in the link's idle time per planning layer
        self.block_per_layer_s = 0.0  # running blocking per layer and step
        self.checked = 0  # candidates checked against routing so far
        self.host_s = 0.0  # running host seconds of one planning layer (runtime only; 0 = not timed)
        self.copy_host_s = 0.0  # h: the compute thread's seconds per copy's I/O work (runtime only)
        self.force_open = force_open
        self._last: tuple[float, float, int, int] | None = None  # (clock, blocking, misses, demand)

    # ------------------------------------------------------------------ precision
    def precision(self) -> np.ndarray:
        """``[D, E]`` running precision by layer distance (row ``d - 1``) and rank (column);
        read-only for callers (updated in place as :meth:`observe` scores candidates)."""
        return self._precision

    def note(self, distance0: int, first_layer: int, cand: np.ndarray) -> None:
        """Remember a plan's candidates for checking when their layers route: ``cand [3, n]``
        (int64 rows ``r``, ``c``, ``rank``, as ``kernels.gate_plan`` returns them); entry ``i``
        is expert ``c[i]`` of layer ``first_layer + r[i]``, ranked ``rank[i]`` by the predictor
        in its layer's row, ``distance0 + r[i]`` layers ahead of the routed one
        (``kernels.note_candidates``; the runtime's plans note inside ``kernels.limit_gate_plan``).

        Pass only candidates a prefetch would copy (not resident or loading): they are used less
        often than the predictor's resident picks, and their precision is the one that matters.
        """
        cand = np.ascontiguousarray(cand, dtype=np.int64)
        kernels.note_candidates(self._noted, self._noted_n, cand[0], cand[1], cand[2], first_layer, distance0)

    def observe(self, layer: int, topk_ids: np.ndarray) -> None:
        """Layer ``layer`` routed ``topk_ids [T, k]``: score the candidates noted for it
        (``kernels.score_noted``)."""
        self.checked += kernels.score_noted(
            self._figures, self._noted, self._noted_n, layer, routed_ids(topk_ids), self.decay
        )

    def plan_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(figures [3, D, E], noted [L, D, 2, E], noted_n [L, D])``: the arrays
        ``kernels.limit_gate_plan`` scores and notes in place (the plan adds what it scored to
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
        b = transfer_s if self.block_per_miss_s is None else self.block_per_miss_s
        p_used = np.ascontiguousarray(p_used, dtype=np.float64)
        reuse = np.ascontiguousarray(reuse, dtype=np.float64)
        idle = np.arange(p_used.size) < int(self.idle_copies)
        keep, net = kernels.pays(
            p_used, b, self.demand_busy, transfer_s, reuse, self.force_open, idle, self.idle_save(transfer_s),
            self.copy_host_s,
        )  # fmt: skip
        return keep, self.plans_pay(net)

    def idle_save(self, transfer_s: float) -> float:
        """Seconds a right prefetch copied in idle link time saves: the next layer's demand
        copies run one fewer, so its wait shortens by up to one copy's time ``t``, as far as the
        layer blocks at all (:attr:`block_per_layer_s`); at least ``b``, the mean blocking per miss."""
        b = transfer_s if self.block_per_miss_s is None else self.block_per_miss_s
        return max(b, min(transfer_s, self.block_per_layer_s))

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


# A relative cost difference beyond which ModeTrial explores the worse mode 4x less often.
CLEAR_DIFF = 0.5


class ModeTrial:
    """A measured comparison of the policy's modes (arms) on the runtime's own clock.

    NOTE: the gain/cost test rests on modelled terms (one avoided miss saves ``b``; idle link time
    is ``1 - q``), which can be far off on a given host: on the bundled model at a 50% buffer the
    plans promised several times the blocking they saved, while planning and the router
    lookahead cost the compute thread more than that. So the runtime also measures what the
    arms really cost the compute thread per decode step (the ``eam`` policy's measure): its wall
    time from the step's first routed layer to its end less the time it stood runnable without
    a CPU (``moe_runtime.prefetch.run_clock``). That holds everything the arms change on that
    thread: planning and the router lookahead, the cache policy's hooks, the expert batches a
    miss adds (each landed batch is a grouped call of its own), blocking on copies, and the GIL
    waits that copies overlapping its work cause (the I/O thread's Python for each copy it
    starts and lands; with prefetching pinned on they were 1-3 ms of a 20-28 ms step on the
    bundled model at a 10% buffer and 0.5 GB/s, against about 0 for caching alone). Before, the
    measure was blocking plus the thread's CPU time, which missed those waits, and the trial
    kept prefetching on where it was no faster. (Plain wall time had been tried before that and
    dropped as too noisy; the run delay taken off is the part of wall time a loaded host adds
    that no arm causes, though on this host it was only about 0.02 ms per step.) Where the
    kernel does not report the run delay, the measure is blocking plus CPU time.

    The ``eam`` policy runs two arms by default (``moe_runtime.prefetch.eam.ARMS``): ``prefetch``
    (plans, router lookahead and the loop-aware ``eam-reuse`` cache) and ``cache`` (no planning,
    the ``eam-reuse`` cache: caching alone, the reference); a third, ``lean`` (no planning, the
    cache evicting LRU: on-demand + LRU but for the tracer), can be added. With the cache
    counting every token alike LRU won at a 50% buffer, where the loop-aware cache made more
    demand copies in decode; weighing decode routing above the prompt's it no longer does, and
    exploring LRU cost more than it found (issue 15).

    Decode steps (no prefill token) run in windows of ``window`` steps, one arm per window. A
    window's cost is its steps' summed cost over their summed work (the caller's measure of what
    the steps asked for, e.g. expert lookups: steps whose batch needs more distinct experts cost
    more under every arm, and would otherwise add their spread to the comparison).
    After a switch the first ``settle`` steps are not counted: the buffer still holds what the
    other arm chose (the cache policy differs too), so the first window after a switch inherits
    the other arm's cache and can look cheaper or dearer than the arm is (issue 15: a bias
    towards on-demand; the old single skipped step left it in the pairs); ``settle`` steps turn
    over a good part of the buffer. A step with prefill tokens (new requests, whose experts are
    not cached yet) drops the open window and the step after it. Two adjacent windows of
    different arms ``a``, ``b`` form a pair, and their relative difference in that cost per
    unit of work, ``(a - b) / mean``, is kept as a running mean per pair of arms (``decay`` per
    pair): pairs, not long-run means, so a host whose load drifts compares like with like. The
    first windows alternate the last arm, the reference, with the other arms (with three arms and
    ``first_pairs=3``: ``0, 2, 0, 2, 1, 2, 1, 2``; with the ``eam`` policy's two: ``0, 1, 0, 1``,
    caching alone the reference) until each other arm has ``first_pairs`` pairs with it: each is
    measured both before and after the reference, so a cost that drifts within a batch (its early
    decode steps miss more) largely cancels out of its running difference. Then the arm with the
    lowest score runs (a least squares fit of one score per arm to the measured pair differences,
    :meth:`scores`; with two arms: the cheaper one), and every ``explore_every``-th window another
    arm, in turn (two more pairs; every ``4 * explore_every``-th while the explored arm is worse by
    more than ``CLEAR_DIFF``, as on-demand is on a fast link, where each exploring window costs a
    lot), so the choice follows the load. Each exploration that leaves the choice as it was doubles
    the interval to the next one, up to ``2 ** max_backoff`` times (an exploring window is the
    worse arm's cost plus ``settle`` steps: in ``bench policies``' short runs of the bundled model
    without a link or at 32 GB/s, one such excursion, 8 of the 69 measured decode steps, was most
    of what kept ``eam`` 2-6% behind on-demand + LRU at a 50% buffer); a changed choice resets it.

    Args:
        window: measured decode steps per window, >= 1.
        explore_every: every this many windows another arm runs once, >= 2.
        decay: weight of the past pairs in the running differences, in ``[0, 1)``.
        first_pairs: pairs per adjacent pair of arms measured (cycling) before a choice, >= 1.
        settle: decode steps not counted after a switch, >= 1.
        max_backoff: the exploration interval doubles at most this many times, >= 0.
        arms: the arms' names, at least two; the first is the prefetching one (:attr:`on`).

    Raises:
        ValueError: a value outside those ranges.
    """

    def __init__(
        self,
        window: int = 4,
        explore_every: int = 8,
        decay: float = 0.7,
        first_pairs: int = 3,
        settle: int = 4,
        max_backoff: int = 3,
        arms: tuple[str, ...] = ("prefetch", "lean"),
    ) -> None:
        if (
            window < 1
            or explore_every < 2
            or not 0 <= decay < 1
            or first_pairs < 1
            or settle < 1
            or max_backoff < 0
            or len(arms) < 2
        ):
            raise ValueError(
                "mode trial: window >= 1, explore_every >= 2, decay in [0, 1), first_pairs >= 1, "
                f"settle >= 1, max_backoff >= 0, two arms or more; got {window}, {explore_every}, "
                f"{decay}, {first_pairs}, {settle}, {max_backoff}, {arms}"
            )
        self.window, self.explore_every, self.decay = window, explore_every, decay
        self.first_pairs, self.settle, self.max_backoff = first_pairs, settle, max_backoff
        self.arms = tuple(arms)
        n = len(arms)
        self.reference = n - 1  # the first windows alternate it with each other arm
        self.arm = 0  # the arm of the current window (0: prefetching)
        # arms the caller ruled out for now (:meth:`bar`); a list, not an array: read at every
        # step's end, where a numpy reduction of it cost 8-27 us (caches cold after the step)
        self.barred = [False] * n
        self.diffs = np.zeros((n, n))  # running (a - b) / mean of paired windows; antisymmetric
        self.pair_counts = np.zeros((n, n), dtype=np.int64)  # pairs measured per pair of arms
        self.pairs = 0  # pairs measured
        self.decode_steps = 0  # decode-only steps seen, and those run in each arm
        self.decode_steps_by_arm = [0] * n
        self._best: int | None = None  # the arm chosen at the last window
        self._since = 0  # windows since the last exploration
        self._streak = 0  # explorations in a row that left the choice as it was
        self._next_explore = 0  # index into the other arms of the next one explored
        self._sum, self._work, self._n = 0.0, 0.0, 0  # the open window's cost, work and steps
        self._skip = 1  # steps of the current window not counted yet
        self._prev: tuple[int, float] | None = None  # (arm, s per unit of work) of the last window

    @property
    def on(self) -> bool:
        """Whether the current window prefetches (the first arm)."""
        return self.arm == 0

    @property
    def arm_name(self) -> str:
        return self.arms[self.arm]

    def bar(self, arm: str, barred: bool) -> None:
        """Rule ``arm`` out (``barred``) or in again: a barred arm is neither chosen nor explored
        from the next window on (the caller knows it cannot win, e.g. prefetching when a step
        blocks for less than its planning costs). The last arm cannot be barred.

        Raises:
            ValueError: an unknown arm, or barring the last one.
        """
        i = self.arms.index(arm) if arm in self.arms else -1
        if i < 0 or (barred and i == self.reference):
            raise ValueError(f"cannot bar arm {arm!r} of {self.arms} (the last one is never barred)")
        self.barred[i] = bool(barred)

    @property
    def settled(self) -> bool:
        """Whether the current arm is the only one allowed (the reference, every other arm
        barred): no pair can form, so a step's cost need not be measured (:meth:`rest`)."""
        return self.arm == self.reference and sum(self.barred) == len(self.arms) - 1

    def rest(self, decode_only: bool) -> None:
        """A step ended that was not measured (while :attr:`settled`): it is counted, and the
        open window and the last window's cost are dropped, so that once another arm is allowed
        again the measuring starts afresh (its first step not counted, as after a prefill)."""
        if decode_only:
            self.decode_steps += 1
            self.decode_steps_by_arm[self.arm] += 1
        self._sum, self._work, self._n, self._prev = 0.0, 0.0, 0, None
        self._skip = max(self._skip, 1)

    @property
    def diff(self) -> float:
        """Running ``(prefetch - lean) / mean`` of the first and the last arm's paired windows;
        < 0: prefetching is cheaper."""
        return float(self.diffs[0, -1])

    def scores(self) -> np.ndarray:
        """``[arms]`` relative cost of each arm (lower: cheaper; they sum to 0): the least
        squares fit of ``s_a - s_b`` to the running difference of every pair of arms measured so
        far. An arm never paired scores 0."""
        n = len(self.arms)
        a, b = np.nonzero(np.triu(self.pair_counts, 1))
        if not a.size:
            return np.zeros(n)
        m = np.zeros((a.size + 1, n))
        m[np.arange(a.size), a] = 1.0
        m[np.arange(a.size), b] = -1.0
        m[-1] = 1.0  # the scores sum to 0
        target = np.append(self.diffs[a, b], 0.0)
        return np.linalg.lstsq(m, target, rcond=None)[0]

    def end_step(self, cost_s: float, decode_only: bool, work: float = 1.0) -> bool:
        """A step ended that cost the compute thread ``cost_s`` seconds (e.g. blocking and CPU
        time) for ``work`` units of work (> 0; e.g. its expert lookups); ``decode_only``:
        it had no prefill token. Returns True when the arm changed (the caller then switches
        the policy's mode to :attr:`arm_name`)."""
        if decode_only:
            self.decode_steps += 1
            self.decode_steps_by_arm[self.arm] += 1
        else:
            # New requests change what a step costs (their experts are not cached yet): the
            # open window is dropped and no pair spans the change.
            self._sum, self._work, self._n, self._prev = 0.0, 0.0, 0, None
            self._skip = max(self._skip, 1)
            return False
        if self._skip:
            self._skip -= 1
            return False
        self._sum += cost_s
        self._work += work
        self._n += 1
        if self._n < self.window:
            return False
        m = self._sum / self._work if self._work > 0 else 0.0
        self._sum, self._work, self._n = 0.0, 0.0, 0
        prev, self._prev = self._prev, (self.arm, m)
        if prev is not None and prev[0] != self.arm and m + prev[1] > 0:
            self._pair(self.arm, m, prev[0], prev[1])
        was = self.arm
        n = len(self.arms)
        ref = self.reference
        allowed = [a for a in range(n) if not self.barred[a]]
        young = [a for a in allowed if a != ref and self.pair_counts[ref, a] < self.first_pairs]
        if young:
            # alternate the reference arm with each other one in turn until each has its first pairs
            if self.arm == ref:
                self.arm = young[self._next_explore % len(young)]
                self._next_explore += 1
            else:
                self.arm = ref
        elif len(allowed) == 1:
            self.arm = ref  # every other arm is barred
        else:
            scores = self.scores()
            best = min(allowed, key=lambda a: (scores[a], a))  # ties: the earlier arm
            if best != self._best:
                self._streak = 0  # the choice changed: re-check it at the base rate
            self._best = best
            others = [a for a in allowed if a != best]
            explore = others[self._next_explore % len(others)]
            # a clear difference is re-checked 4x less often (exploring it costs more), and each
            # exploration that confirmed the choice halves the rate
            clear = scores[explore] - scores[best] > CLEAR_DIFF
            every = self.explore_every * (4 if clear else 1)
            every <<= min(self._streak, self.max_backoff)
            self._since += 1
            if self._since >= every:
                self._since = 0
                self._streak += 1
                self._next_explore += 1
                self.arm = explore
            else:
                self.arm = best
        if self.arm != was:
            self._skip = self.settle
        return self.arm != was

    def _pair(self, a: int, cost_a: float, b: int, cost_b: float) -> None:
        """Two adjacent windows of arms ``a`` and ``b`` cost ``cost_a`` and ``cost_b`` s per unit of work."""
        d = 2 * (cost_a - cost_b) / (cost_a + cost_b)
        if self.pair_counts[a, b]:
            d = self.decay * self.diffs[a, b] + (1 - self.decay) * d
        self.diffs[a, b], self.diffs[b, a] = d, -d
        self.pair_counts[a, b] += 1
        self.pair_counts[b, a] += 1
        self.pairs += 1
