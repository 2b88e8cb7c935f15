"""The ``eam`` policy's use of the cost gate (ours, not in MoE-Infinity): when a layer plans, what
a plan's host time costs, and the plan's one compiled call from prediction to the queue.

The paper's plan (MoE-Infinity §5.1, :mod:`moe_runtime.prefetch.eam`) issues the best candidates
of every later layer after every routed layer. With the gate (``cost_aware``, the default) the
policy issues only the candidates whose expected gain beats their expected cost
(:class:`~moe_runtime.prefetch.gate.PrefetchGate`, the terms), and while a plan's paying
candidates do not win back its host time it stops planning and only probes every
``probe_every``-th layer: it is on-demand. :class:`GatedPlanning` is that side of the policy, a
base class of :class:`~moe_runtime.prefetch.eam.EAMPrefetch`: the routed layer's hook with the
gate (:meth:`GatedPlanning._gated_routing`), the step's link terms, the victims' next-step use,
and the note of a plan's EAMC-term candidates for the weighed term
(:mod:`moe_runtime.prefetch.term_value`). The simulator keeps the gate alone (its host time is 0:
deterministic).
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

import moe_runtime.prefetch.gate_kernels as gate_kernels
import moe_runtime.prefetch.term_kernels as term_kernels
from moe_runtime.errors import ConfigError
from moe_runtime.prefetch.gate import PrefetchGate, routed_ids
from moe_runtime.prefetch.term_value import TermValue

_NO_USE = np.zeros(0)  # no victim-use term (GatedPlanning._victim_use)
# The share of the runtime's planning layers whose host time is measured (thread CPU time, for the
# gate's and the EAMC term's running means): the clock is a system call, 1.6 us p50 per read in
# ``bench overhead``'s planning layers at batch 16, two reads per plan and two per router
# lookahead. Drawn at random, so the plans measured do not fall on the same layers every step.
HOST_SAMPLE = 0.25


class GatedPlanning:
    """The ``eam`` policy's cost gate: when to plan, the plan's host time, the gate's call. A base
    class of :class:`~moe_runtime.prefetch.eam.EAMPrefetch`, whose prediction (``_plan``,
    ``_own``, ``_own_rows``), router lookahead (``_no_ahead``, ``lookahead_weight``) and trial
    (``idle``, ``trial``) attributes it uses."""

    buffer: Any
    num_layers: int
    num_experts: int
    depth: int

    def _init_gating(self, cost_aware: bool, probe_every: int, weigh_eamc: bool) -> None:
        """``cost_aware``: test every candidate (else issue every plan); ``probe_every``: while
        plans do not pay, plan only every this many layers; ``weigh_eamc``: in the runtime, weigh
        the EAMC term against its host time (:mod:`moe_runtime.prefetch.term_value`).

        Raises:
            ConfigError: ``probe_every < 1``.
        """
        # gain/cost test of every candidate (moe_runtime.prefetch.gate); None = issue every plan
        self.gate = PrefetchGate(self.num_layers, self.num_experts, self.depth) if cost_aware else None
        self._queued = True  # the last plan handed to the buffer was not empty
        self._planning = True  # plan every layer (else only every probe_every-th one probes)
        if probe_every < 1:
            raise ConfigError(f"eam probe_every must be >= 1, got {probe_every}")
        self.probe_every = probe_every
        # The runtime (wall clock = compute clock) times each planning layer (thread CPU time)
        # for the gate; the simulator, whose clock is not the host's, does not (its results
        # stay deterministic).
        self._timed = getattr(self.buffer, "now", None) is None
        # whether the next plan's host time (and its router lookahead's) is measured (HOST_SAMPLE)
        self.plan_timed = True
        self._sampler = random.Random(0)
        self._p_use: tuple[np.ndarray, int, np.ndarray] | None = None  # (own term, T, [L * E] p)
        # victim_kernels.least_used's sort of that p (reset with it): [L * E] order, [3] heap work
        # so far, sorted, plans still expected in the step (set at each plan)
        self._use_order = np.zeros(self.num_layers * self.num_experts, dtype=np.int32)
        self._use_state = np.zeros(3, dtype=np.int64)
        # the gate's plan, written by gate_kernels.limit_gate_plan (at most depth x E keys)
        self._plan_keys = np.zeros(self.depth * self.num_experts, dtype=np.int64)
        self._plan_priorities = np.zeros(self.depth * self.num_experts)
        # the EAMC term's measured gain against its host time (term_value); None: always computed
        self.eamc_term = TermValue(probe_every) if cost_aware and self._timed and weigh_eamc else None
        # host seconds of the EAMC term in the latest prediction (with eamc_term; None: not measured)
        self._eamc_s: float | None = None
        self._step_link: tuple[float, np.ndarray] | None = None  # the step's gate terms (_link_terms)

    def _gated_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """``after_routing`` with the gate: score the earlier plans' candidates for ``layer``
        against its routing ``topk_ids [T, k]``, and plan unless the trial's arm has no plans or
        the policy is on-demand for now (then every ``probe_every``-th layer probes); in the
        runtime, time a sample of the plans (:data:`HOST_SAMPLE`) for the gate's host-time term."""
        gate = self.gate
        if self._step_t0 is None and self._run_clock is not None:  # the step's first routed layer
            self._step_t0 = self._run_clock.wall()
        self._decode_only &= topk_ids.shape[0] == len(request_ids)  # one token per request
        if self.idle:
            # A window without plans (caching alone or lean; the arm changes only at a step's
            # end, and the next plan's first layer starts the matcher afresh): nothing to do.
            self._ahead = None
            self._lookahead_s = 0.0
            return
        if self.eamc_term is not None:
            self.eamc_term.observe(layer, topk_ids)
        if not self.wants_lookahead(layer):
            gate.observe(layer, topk_ids)  # score the earlier plans' candidates for this layer
            # On-demand for now (the last plan kept nothing): only every probe_every-th layer
            # predicts, to keep the precision current and to notice when prefetching pays again.
            self._ahead = None
            self._lookahead_s = 0.0
            self._defer_match(layer, request_ids)
            return
        # the plan scores the earlier plans' candidates for this layer in its compiled call
        # (_paying); one that stops before it does so here
        if self._timed:  # the runtime: the plan's host time is a cost the gate weighs
            if not self.plan_timed:  # not sampled (HOST_SAMPLE)
                scored = self._plan(layer, request_ids, topk_ids)
            else:
                t0 = time.thread_time()
                scored = self._plan(layer, request_ids, topk_ids)
                host = time.thread_time() - t0 + self._lookahead_s
                if topk_ids.shape[0] == len(request_ids):  # a decode layer: the cost the bar weighs
                    gate.note_host_time(host)
            self.plan_timed = self._sampler.random() < HOST_SAMPLE
            self._lookahead_s = 0.0
        else:
            scored = self._plan(layer, request_ids, topk_ids)
        if not scored:
            gate.observe(layer, topk_ids)

    def wants_lookahead(self, layer: int) -> bool:
        """Whether :meth:`after_routing` of ``layer`` will plan, so the model should compute the
        router lookahead for it (it skips that work while the policy is on-demand)."""
        if self.idle:  # caching alone or lean: no plans
            return False
        return self.gate is None or self._planning or layer % self.probe_every == 0

    def _note_eamc_term(
        self, term: TermValue, layer: int, base: np.ndarray, spec: np.ndarray | None, cap: int
    ) -> None:
        """Note for ``term`` (:mod:`moe_runtime.prefetch.term_value`) the next layer's candidates
        of this plan (``base [D, E]``, the EAMC term in, with the router lookahead ``spec [d,
        E]`` of :meth:`_plan_rows` blended in) and of the plan without the EAMC term (the step's
        own term alone, normalised as :meth:`_predict_rows` does, blended with the same
        lookahead): the ``cap`` best experts of each that the buffer does not hold, in one
        compiled call (``term_kernels.term_candidates``). Nothing before the step's own term exists."""
        if self._own is None:
            return
        lo, E = layer + 1, self.num_experts
        own = self._own_rows()[0][lo : lo + 1]
        held = self.buffer.held[lo * E : (lo + 1) * E]
        ahead = self._no_ahead if spec is None else spec
        term.note(lo, *term_kernels.term_candidates(base, own, ahead, self.lookahead_weight, held, cap))

    def _block_per_miss_s(self) -> float:
        """Seconds one avoided miss saves: the gate's running blocking per miss ``b``, before
        any miss one copy's link time."""
        if self.gate is None:
            return self._transfer_s()
        return self._link_terms()[0]

    def _link_terms(self) -> tuple[float, np.ndarray]:
        """The step's ``(b, terms)`` for the gate: ``b`` (:meth:`_block_per_miss_s`) and
        ``gate_kernels.gate_terms`` of the lookahead weight, ``b``, ``q``, ``t`` (:meth:`_transfer_s`),
        the gate's ``force_open``, the buffer's slots, the gate's idle copies,
        ``PrefetchGate.idle_save`` and ``h``. Read at the step's first plan and kept until its
        end: the gate's figures change only at a step's end (``PrefetchGate.update_link``,
        :meth:`end_step`), the simulator's link time never, and the runtime's measured copy time
        is a running mean that one step's copies barely move."""
        terms = self._step_link
        if terms is None:
            gate, t = self.gate, self._transfer_s()
            b = gate.miss_cost_s(t)  # the running blocking per miss, capped by a CPU miss's time
            packed = gate_kernels.gate_terms(
                self.lookahead_weight, b, gate.demand_busy, t, gate.force_open, self.buffer.num_slots,
                gate.idle_copies, gate.idle_save(t), gate.copy_host_s, gate.decay,
            )  # fmt: skip
            terms = self._step_link = (b, packed)
        return terms

    def _paying(
        self,
        gate: PrefetchGate,
        layer: int,
        lo: int,
        probs: np.ndarray,
        spec: np.ndarray | None,
        cap: int,
        min_prob: float,
        weights: np.ndarray,
        topk_ids: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The plan ``(keys [m], priorities [m])``, best first (:meth:`issue_ranked`): of the
        scores ``[D, E]`` (``probs [D, E]`` of layers ``lo ..`` with the router lookahead ``spec
        [d, E]`` blended in (:meth:`_plan_rows`), limited to each row's ``cap`` largest at or
        above ``min_prob``, times ``weights [D]``), the candidates whose expected gain beats
        their expected cost (``moe_runtime.prefetch.gate``); None when none pays and no plan of
        ours is queued (nothing to hand the buffer). One compiled call scores the candidates
        earlier plans noted for ``layer`` against its routing ``topk_ids [T, k]``, blends,
        limits, ranks and tests the candidates, finds their victims, orders the plan and notes
        its candidates for their layers (``gate_kernels.limit_gate_plan``)."""
        terms = self._link_terms()[1]
        # the plans still expected in this step, this one included (the last layer never plans):
        # least_used sorts the victims' use once when they would make its heap passes dearer
        every = 1 if self._planning else self.probe_every
        self._use_state[2] = (self.num_layers - 2 - layer) // every + 1
        # the predictor's candidates a prefetch would copy, ranked within their row, and those of
        # them that pay
        figures, noted, noted_n = gate.plan_state()
        m, net, scored = gate_kernels.limit_gate_plan(
            probs, self._no_ahead if spec is None else spec, weights, self.buffer.held, figures, noted,
            noted_n, routed_ids(topk_ids), self._victim_use(topk_ids.shape[0]), self._use_order,
            self._use_state, terms, self._plan_keys, self._plan_priorities, cap, min_prob,
            lo * self.num_experts, lo - layer, layer,
        )  # fmt: skip
        gate.checked += scored
        # the plan's host time is spent: what pays is issued; planning goes on at every layer
        # only while it wins that time back (else every probe_every-th layer probes)
        self._planning = gate.plans_pay(net)
        queued, self._queued = self._queued, m > 0
        if not self._queued and not queued:
            return None
        # views of the policy's plan arrays: the buffer's queue copies what it keeps
        return self._plan_keys[:m], self._plan_priorities[:m]

    def _victim_use(self, tokens: int) -> np.ndarray:
        """``[L * E]`` chance each expert is used in the next step, ``p = 1 - (1 - share)^T`` from
        the batch's own EAM (``share``: its tokens' share routed to the expert so far, ``T``
        tokens per step): the ``eam-reuse`` cache's formula, on the request EAMs unweighted (the
        cache itself weighs prompt tokens ``PREFILL_WEIGHT``; reading its ``p_use`` here instead
        left the prefetching arm's TPOT as it was); computed once per step. Empty before the
        step's own term exists (no reuse term then)."""
        own = self._own
        if own is None:
            return _NO_USE
        if self._p_use is None or self._p_use[0] is not own or self._p_use[1] != tokens:  # once a step
            weight = self.own_weight if self.own_weight > 0 else 1.0
            share = np.minimum(own.reshape(-1) * (self.top_k / weight), 1.0)
            self._p_use = (own, tokens, 1.0 - (1.0 - share) ** tokens)  # [L * E]
            self._use_state[:2] = 0  # a new p: not sorted yet
        return self._p_use[2]

    def _transfer_s(self) -> float:
        """One expert copy's link time: the simulator's; else as the I/O threads timed the copies
        (``ExpertBuffer.copy_seconds``: the copy stream's time on CUDA, the memcpy on the CPU, an
        emulated link's own time); before the first copy the emulated link's, else the measured
        blocking per miss."""
        t = getattr(self.buffer, "transfer_s", None)
        if t is not None:
            return float(t)
        measured = getattr(self.buffer, "copy_seconds", None)
        if measured is not None:
            return measured
        part = self.buffer.parts[0]
        link = getattr(part, "link", None)
        if link is not None:
            return link.transfer_seconds(part.expert_nbytes)
        return self.gate.block_per_miss_s or 0.0
