"""The ``eam`` policy's arms under the measured trial (ours, runtime only; not in MoE-Infinity).

The runtime runs decode steps in windows, each in one of the policy's modes (:data:`MODES`:
``prefetch``, ``cache``, ``lean``), and :class:`~moe_runtime.prefetch.trial.ModeTrial` picks the
arm that costs the compute thread least. :class:`TrialArms` is the policy's side of it, a base
class of :class:`~moe_runtime.prefetch.eam.EAMPrefetch`: switching arms (:meth:`TrialArms.set_arm`,
:meth:`TrialArms.pin`), a step's cost measured at its end on the run clock
(:mod:`moe_runtime.prefetch.run_clock`), the bar on prefetching while it cannot pay, and the
gate's link figures refreshed at a step's end (:meth:`TrialArms.end_step`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from moe_runtime.errors import ConfigError
from moe_runtime.prefetch.gate import clock
from moe_runtime.prefetch.run_clock import RunClock
from moe_runtime.prefetch.trial import MODES, ModeTrial


class TrialArms:
    """The ``eam`` policy's arms and its measured trial. A base class of
    :class:`~moe_runtime.prefetch.eam.EAMPrefetch`, whose gate (``gate``, ``_transfer_s``,
    ``_timed``, ``eamc_term``, ``_queued``, ``_planning``) it reads and sets."""

    buffer: Any
    num_layers: int

    def _init_arms(self, cost_aware: bool, trial: bool, trial_arms: tuple[str, ...]) -> None:
        """``trial``: in the runtime (not the simulator), with ``cost_aware``, run the trial of
        ``trial_arms`` (a subset of :data:`MODES` in that order, ``prefetch`` first, two or more).

        Raises:
            ConfigError: bad arms.
        """
        # the runtime's measured comparison of its modes (trial.ModeTrial); None in the simulator
        # and without the gate
        arms = tuple(trial_arms)
        if len(arms) < 2 or arms[0] != "prefetch" or [m for m in MODES if m in arms] != list(arms):
            raise ConfigError(f"eam trial arms must be 'prefetch' and more of {MODES}, in order; got {arms}")
        self.trial = ModeTrial(arms=arms) if cost_aware and self._timed and trial else None
        self._pinned: str | None = None  # the arm :meth:`pin` holds the policy in (None: the trial's)
        self._decode_only = True  # no prefill token in the step so far (for the trial)
        self._step_cpu_s: float | None = None  # the compute thread's CPU clock at the last step's end
        self._step_blocking_s = 0.0  # the buffer's blocking counter at the last step's end
        self._step_lookups = 0  # and its expert lookups
        # the trial's cost of a step: the compute thread's wall time less its run delay from the
        # step's first routed layer to its end (run_clock); CPU time plus blocking where the
        # kernel does not report the run delay
        self._run_clock = RunClock() if self.trial is not None else None
        self._step_t0: float | None = None  # wall clock at the step's first routed layer
        self._step_delay_s: float | None = None  # the run delay at the last step's end
        self._unplanned_blocking_s: float | None = None  # running blocking of decode steps without plans

    @property
    def idle(self) -> bool:  # type: ignore[override]
        """Whether the trial runs an arm without plans (caching alone or lean): the model then
        hands only layer 0's routing over (the step's start, for the trial) and computes no
        router lookahead (``PrefetchPolicy.idle``)."""
        pinned = self._pinned
        if pinned is not None:
            return pinned != "prefetch"
        return self.trial is not None and not self.trial.on

    def set_arm(self, arm: str) -> None:
        """Run as one of :data:`MODES`: ``prefetch`` (the full policy), ``cache`` (no planning,
        no router lookahead; the ``eam-reuse`` cache keeps its loop-aware choice) or ``lean``
        (on-demand + LRU: an ``eam-reuse`` cache evicts LRU, ``EAMReuseCachePolicy.lru``, so
        not even the cache's counts are paid for). Leaving ``prefetch`` cancels what the plans
        queued. The tracer keeps recording: the EAMC still fills as requests finish.

        Raises:
            ValueError: an unknown arm.
        """
        if arm not in MODES:
            raise ValueError(f"eam arm must be one of {MODES}, got {arm!r}")
        buf = self.buffer
        with buf.cond:
            if arm != "prefetch" and self._queued:
                buf.prefetch(np.zeros(0, dtype=np.int64), np.zeros(0), replace=True)
            self._queued = self._planning = arm == "prefetch"  # prefetching again: the next layer plans
            for part in buf.parts:
                if hasattr(part.policy, "lru"):
                    part.policy.lru = arm == "lean"

    def pin(self, arm: str) -> None:
        """Hold the policy in ``arm`` (one of :data:`MODES`, as :meth:`set_arm`) from now on, for
        measurements: the trial, if any, is suspended (it neither measures, switches nor counts
        steps any more), and the prefetch bar is not weighed. ``moeserve bench ab``'s ``eam@<arm>``
        rows compare the arms this way.

        Raises:
            ValueError: an unknown arm.
        """
        self.set_arm(arm)
        self._pinned = arm

    def _bar_prefetch(self, blocking_s: float) -> None:
        """A decode step without plans blocked ``blocking_s`` on expert copies: bar the trial's
        prefetching arm while such steps block (running mean) for less than a step of plans costs
        the compute thread (the gate's host time per planning layer times the layers that plan):
        prefetching can at best remove all blocking, so it cannot pay then (a fast link, a large
        buffer), and exploring it would only cost. The host time fades while no plan runs
        (:meth:`PrefetchGate.forget_host_time`), so a bar set under a passing load lifts and
        the trial times plans again."""
        old = self._unplanned_blocking_s
        self._unplanned_blocking_s = blocking_s if old is None else 0.8 * old + 0.2 * blocking_s
        self.gate.forget_host_time()  # not re-measured while barred: let it fade
        plans_s = self.gate.host_s * (self.num_layers - 1)
        self.trial.bar("prefetch", plans_s > 0 and self._unplanned_blocking_s < plans_s)

    def end_step(self) -> None:
        """A step ended: refresh the gate's link figures (unless no plan will read them), drop
        its unchecked candidates, and measure the step's cost for the trial, which may switch
        the arm (:meth:`set_arm`)."""
        self._step_link = None  # the gate's figures change here (_link_terms)
        gate = self.gate
        if gate is not None:
            pinned = self._pinned
            settled = self.trial is not None and (pinned is not None or self.trial.settled)
            if not settled or pinned == "prefetch":  # the plans' link figures; else no plan reads them
                now = clock(self.buffer)
                gate.update_link(self.buffer.stats, now, self._transfer_s())
                if self._timed:  # h: the I/O threads' own work per copy (none in the simulator)
                    gate.copy_host_s = getattr(self.buffer, "copy_host_seconds", None) or 0.0
                    # hybrid execution: a miss costs at most the CPU's time for it (b's cap)
                    gate.cpu_miss_s = getattr(self.buffer, "cpu_miss_seconds", None)
            gate.new_step()
            if self.eamc_term is not None:
                self.eamc_term.new_step()
            if settled:
                # Caching alone and prefetching barred (_bar_prefetch), or an arm pinned (pin): no
                # pair of arms can form, so the step's cost is not measured (the run delay's pread
                # alone was about 16 us of a 6.5 ms decode step at batch 1), nor the link's figures
                # for the plans (the first update after the bar lifts spans the whole rest: a mean
                # over it); only the bar is weighed again, and not while an arm is pinned.
                stats = self.buffer.stats
                blocking = stats.total_blocking_s
                if self._decode_only and self.idle and pinned is None:
                    self._bar_prefetch(blocking - self._step_blocking_s)
                self._step_blocking_s, self._step_lookups = blocking, stats.total_lookups
                self._step_cpu_s = self._step_delay_s = None  # measured afresh once unbarred
                if pinned is None:
                    self.trial.rest(self._decode_only)
            elif self.trial is not None:
                # what the step cost the compute thread from its first routed layer on: its wall
                # time less its run delay (run_clock: plans, router lookahead, cache policy, the
                # experts' batches, blocking and the GIL waits copies cause, all of which the arms
                # change; not the host's preemption), else its blocking on expert copies plus its
                # CPU time; per expert lookup, what the batch asked for (see trial.ModeTrial)
                stats = self.buffer.stats
                blocking, lookups, cpu = stats.total_blocking_s, stats.total_lookups, time.thread_time()
                # the run delay is read once a step (a pread, dear: run_clock): what accrued
                # since the last step's end is taken off, the gap between steps included
                delay, prev = self._run_clock.delay(), self._step_delay_s
                self._step_delay_s = delay
                if delay is not None and self._step_t0 is not None:  # waits included, preemption not
                    cost = self._run_clock.wall() - self._step_t0 - (0.0 if prev is None else delay - prev)
                else:
                    cost = blocking - self._step_blocking_s
                    if self._step_cpu_s is not None:
                        cost += cpu - self._step_cpu_s
                work = max(1, lookups - self._step_lookups)
                if self._decode_only and self.idle:  # a decode step without plans
                    self._bar_prefetch(blocking - self._step_blocking_s)
                self._step_blocking_s, self._step_cpu_s, self._step_lookups = blocking, cpu, lookups
                if self.trial.end_step(cost, self._decode_only, work):
                    self.set_arm(self.trial.arm_name)
            self._decode_only = True
        self._step_t0 = None
