"""The measured trial of the ``eam`` policy's modes (ours, runtime only; not in MoE-Infinity).

The cost gate (:mod:`moe_runtime.prefetch.gate`) rests on modelled terms; :class:`ModeTrial` also
measures, on the runtime's own clock, what each of the policy's arms costs a decode step, and
runs the cheapest: :data:`ARMS` by default, ``prefetch`` (the plans, the router lookahead and the
``eam-reuse`` cache) against ``cache`` (caching alone). The policy's side of it (switching arms,
measuring a step, the prefetch bar) is :mod:`moe_runtime.prefetch.arms`; its clock is
:mod:`moe_runtime.prefetch.run_clock`. The simulator, whose clock is not the host's, runs no
trial.
"""

from __future__ import annotations

import numpy as np

MODES = ("prefetch", "cache", "lean")
# The runtime trial's default arms (ModeTrial), the prefetching one first, the reference last.
# ``lean`` is left out: once the ``eam-reuse`` cache weighed decode routing above the prompt's
# (``moe_runtime.buffer.policies.PREFILL_WEIGHT``) it beat LRU's hit rate in every replayed setting
# (``tools/cache_headroom.py`` at 0058d22), and the windows spent exploring LRU cost more than they found:
# the two arms against the three, same code otherwise, bench policies' grid workload, 3 repeats,
# were faster at 7 of 8 (link, batch, buffer) points and within the spread at the eighth.
ARMS = ("prefetch", "cache")

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

    The ``eam`` policy runs two arms by default (:data:`ARMS`): ``prefetch``
    (plans, router lookahead and the loop-aware ``eam-reuse`` cache) and ``cache`` (no planning,
    the ``eam-reuse`` cache: caching alone, the reference); a third, ``lean`` (no planning, the
    cache evicting LRU: on-demand + LRU but for the tracer), can be added. With the cache
    counting every token alike LRU won at a 50% buffer, where the loop-aware cache made more
    demand copies in decode; weighing decode routing above the prompt's it no longer does, and
    exploring LRU cost more than it found (``tools/cache_headroom.py`` at 0058d22, ``bench policies``).

    Decode steps (no prefill token) run in windows of ``window`` steps, one arm per window. A
    window's cost is its steps' summed cost over their summed work (the caller's measure of what
    the steps asked for, e.g. expert lookups: steps whose batch needs more distinct experts cost
    more under every arm, and would otherwise add their spread to the comparison).
    After a switch the first ``settle`` steps are not counted: the buffer still holds what the
    other arm chose (the cache policy differs too), so the first window after a switch inherits
    the other arm's cache and can look cheaper or dearer than the arm is (measured: a bias
    towards on-demand, which a single skipped step left in the pairs); ``settle`` steps turn
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
