"""The paper's prefetch algorithm: EAM matching against the EAMC (MoE-Infinity §5.1, Figure 7).

NOTE: after MoE layer ``l`` routes, each running request's EAM so far (its request EAM plus this
iteration's rows up to ``l``; the recorder builds it, §4.1) is matched against the EAMC (§4.2) by
cosine similarity with prefix matching (rows L2-normalised, unseen rows zero, so the score is the
sum of per-layer cosines over seen layers). The top matches of all running requests are summed
and row-normalised into per-expert activation probabilities for every later layer, weighted by
layer proximity ``1 - (i - l) / L`` (Figure 7; ``PrefetchPolicy.proximity``), and the best
experts not yet resident are handed to the I/O queue as a re-prioritised plan (at most ``tokens x
top-k`` experts per later layer: goal (ii) of §5.1, do not spend the link on experts that cannot
all be used). The batch's own EAM so far is added to the matches (skewed reuse, §3.1), so a cold
EAMC still predicts; the EAMC fills online as requests finish, or is loaded from a file saved by
an earlier run. :meth:`EAMPrefetch.predict` is the prediction, :meth:`EAMPrefetch._match` the
matching, :meth:`EAMPrefetch._plan` the plan; the per-row arithmetic is compiled
(:mod:`moe_runtime.prefetch.eam_kernels`).

What is ours, not the paper's, lives in the base classes :class:`EAMPrefetch` takes it from:

* the router lookahead blended into the next layers' rows (:mod:`moe_runtime.prefetch.lookahead`);
* the cost gate: only the candidates whose expected gain beats their cost are issued, and while
  plans do not pay the policy only probes (:mod:`moe_runtime.prefetch.gate`, the terms;
  :mod:`moe_runtime.prefetch.gating`, the policy's side);
* the weighed EAMC term (runtime only, :mod:`moe_runtime.prefetch.term_value`): a plan computes
  it only while its measured gain beats its measured host time, and as a probe at doubling
  intervals otherwise; the matcher catches up on the rows it skipped at its next use, so every
  match is the paper's. The simulator never skips it;
* the measured trial of prefetching against caching alone (runtime only,
  :mod:`moe_runtime.prefetch.trial`, :mod:`moe_runtime.prefetch.arms`).

With ``cost_aware=False`` and no router lookahead (``lookahead=0``) the policy is the paper's.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import moe_runtime.prefetch.eam_kernels as eam_kernels
import moe_runtime.prefetch.gate_kernels as gate_kernels
import moe_runtime.prefetch.term_kernels as term_kernels
import moe_runtime.prefetch.victim_kernels as victim_kernels
from moe_runtime.errors import ConfigError
from moe_runtime.prefetch.arms import TrialArms
from moe_runtime.prefetch.base import PrefetchPolicy
from moe_runtime.prefetch.gating import GatedPlanning
from moe_runtime.prefetch.lookahead import LookaheadBlend
from moe_runtime.prefetch.trial import ARMS
from tracer.prefix_match import PrefixMatcher

# Matching is always incremental (EAMPrefetch._match). A full EAMC search per layer ran below
# 512k multiply-adds (B * n * L * E) until the incremental matcher beat it at every shape measured
# (bench overhead's workload, _match p50 in us, full vs incremental, batch B, n EAMC entries):
# qwen3-30b-a3b B=1 n=32: 56-65 vs 36, B=2 n=32: 80 vs 61; mixtral-8x7b B=1 n=32: 42 vs 33,
# n=256: 38 vs 35, n=1000: 50 vs 37; switch-base-128 B=1 n=32: 34 vs 31, B=4: 50 vs 38;
# deepseek-v3 B=1 n=32: 80 vs 38; tools/sim_fingerprint.py: 0 of 40 runs differ.


class EAMPrefetch(TrialArms, GatedPlanning, LookaheadBlend, PrefetchPolicy):
    """Args (beyond the base): eamc: the EAM collection to match against; matches: top matches
    per request (default 16); min_prob: experts below this activation probability are not
    prefetched (default 0); own_weight: weight of the batch's own EAM so far in the prediction
    (default 1); lookahead, lookahead_weight: the router lookahead's depth (0: none) and weight
    in the blend (default 2; :mod:`moe_runtime.prefetch.lookahead`); cost_aware: issue only the
    candidates whose expected gain beats their expected cost (``moe_runtime.prefetch.gate``;
    default True); probe_every: while the last plan's paying
    candidates did not win back its host time (in the simulator: while it kept nothing; the policy
    is on-demand then), predict only at every ``probe_every``-th layer (default 4), which keeps
    the gate's precision current at a quarter of the host work; trial: in the runtime (not the
    simulator), with ``cost_aware``, also run the measured comparison of prefetching and caching
    alone (:class:`moe_runtime.prefetch.trial.ModeTrial`; default True); trial_arms: its arms, a
    subset of ``trial.MODES`` in that order with ``prefetch`` first and at least two (default
    ``trial.ARMS``; add ``lean``, on-demand + LRU, to measure LRU as well); weigh_eamc: in the
    runtime, with ``cost_aware``, compute the EAMC term of a plan only while its measured gain
    beats its host time, probing every ``probe_every``-th plan otherwise
    (:mod:`moe_runtime.prefetch.term_value`; default True).

    Each later layer keeps at most ``tokens x top_k`` candidates (what this step can route there):
    on the bundled model at a 50% buffer this cut the bytes moved 1.4-6x (emulated link / memcpy)
    for 1-4 points of hit rate. 4, 16 or 32 matches and the own-EAM term moved the hit rate by
    less than the run-to-run spread (about ±0.02).
    """

    name = "eam"

    def __init__(
        self,
        *args: Any,
        eamc: Any | None = None,
        matches: int = 16,
        min_prob: float = 0.0,
        own_weight: float = 1.0,
        lookahead: int = 0,
        lookahead_weight: float = 2.0,
        cost_aware: bool = True,
        probe_every: int = 4,
        trial: bool = True,
        trial_arms: tuple[str, ...] = ARMS,
        weigh_eamc: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.recorder is None or eamc is None:
            raise ConfigError(
                "--prefetch-policy eam needs the request tracer and an EAMC "
                "(created automatically by the engine)"
            )
        self.eamc = eamc
        # compile (or load from numba's cache) every kernel a plan calls, here rather than on a
        # planning layer's clock
        for kernels in (eam_kernels, victim_kernels, gate_kernels, term_kernels):
            kernels.warm()
        self.matches = matches
        self.min_prob = min_prob
        self.own_weight = own_weight
        self._init_lookahead(lookahead, lookahead_weight, kwargs.get("depth"))
        # the latest plan: (first layer, [D, E] rows, [d, E] lookahead blended into them or None)
        self._last: tuple[int, np.ndarray, np.ndarray | None] | None = None
        self._matcher: PrefixMatcher | None = None  # incremental EAMC matching of the running batch
        self._match_ids: list[str] | None = None  # the batch the matcher's step began with
        self._unmatched: list[int] = []  # routed layers the matcher has not taken in yet
        # Resuming the matcher across steps (_match): the engine steps ended so far, the one the
        # matcher last matched in, the rows it took in after their layer routed in that step,
        # and whether the next match resumes from that state
        self._steps = 0
        self._match_step = -1
        self._fed = np.zeros(self.num_layers, dtype=bool)
        self._resume = False
        # per-step state (see predict): the step's batch, the last routed layer, the own term,
        # the EAMC term and its key, their normalised sum and its capped form
        self._epoch = -1  # the recorder's epoch the state below belongs to
        self._step_ids: list[str] | None = None
        self._last_layer = self.num_layers
        self._own: np.ndarray | None = None  # [L, E]
        self._eamc_key: tuple[int, bytes] | None = None
        self._window = (0, 0)  # rows lo:hi the cached terms below cover
        self._eamc_block: np.ndarray | None = None  # [D, E] EAMC term of the window's rows
        self._final: np.ndarray | None = None  # [w1 - w0, E] normalised own (+ EAMC) term of the window
        self._evidence: list[bool] | None = None  # [w1 - w0] window rows with any evidence
        # the own term alone normalised, every row of the step, and its evidence: ([L, E], [L])
        self._own_final: tuple[np.ndarray, list[bool]] | None = None
        self._limited: tuple[int, np.ndarray] | None = None  # (cap, [w1 - w0, E]) capped _final
        self._weights: dict[tuple[int, int], np.ndarray] = {}  # (layer, rows) -> [rows] (_plan_weights)
        self.plans = 0  # layers planned (predicted and tested), for the overhead figures
        self._init_gating(cost_aware, probe_every, weigh_eamc)
        self._init_arms(cost_aware, trial, trial_arms)

    def predict(self, layer: int, request_ids: list[str]) -> np.ndarray | None:
        """Activation probabilities ``[L, E]`` for the running batch, or None without evidence.

        The top EAMC matches of every running request are summed and row-normalised (§5.1); the
        batch's own EAM so far, row-normalised, is added with weight ``own_weight`` (the skewed
        reuse of §3.1: a request keeps choosing the experts it chose) and the sum normalised again.
        Only the rows of the layers a plan from ``layer`` covers (``layer + 1 .. layer + depth``)
        are returned; the others are zero.

        NOTE: per-step reuse. Rows after ``layer`` hold only earlier steps' counts, which do not
        change within a step, so the own term is computed once per step for all rows; the EAMC
        term and the normalised sum are recomputed, for rows ``lo:hi`` only, when the matches
        (or the EAMC) change or a later layer needs rows outside the last window. Row by row the
        numbers are those of a from-scratch computation.
        """
        rows = self._predict_rows(layer, request_ids)
        if rows is None:
            return None
        prob = np.zeros((self.num_layers, self.num_experts), dtype=np.float32)
        prob[layer + 1 : layer + 1 + len(rows)] = rows
        return prob

    def _predict_rows(self, layer: int, request_ids: list[str], eamc: bool = True) -> np.ndarray | None:
        """:meth:`predict`'s rows ``layer + 1 .. layer + depth`` only, ``[D, E]`` (read-only: the
        step's cached rows), or None. ``eamc=False`` leaves the EAMC term out (the own term
        alone; the matcher takes this layer's row in at its next use)."""
        lo, hi = layer + 1, min(self.num_layers, layer + 1 + self.depth)
        if not request_ids or lo >= hi:
            return None
        self._begin_layer(layer, request_ids)
        if self._own is None:  # first routed layer of the step: rows > layer are earlier steps'
            # the batch's [L, E] token counts so far (integers: the same sums as the [B, L, E] query's)
            self._own = _row_probs(self.recorder.query_sum(request_ids, layer))  # [L, E]
            if self.own_weight != 1.0:
                self._own *= self.own_weight
        # the cached rows cover lo:hi unless the EAMC term or the window must change
        w0, w1 = self._window
        covered = self._final is not None and w0 <= lo and hi <= w1
        n = len(self.eamc)
        if n and not eamc:
            if self._match_ids is not None:  # the incremental matcher takes this row later
                self._unmatched.append(layer)
            if self._eamc_key is not None:  # the cached rows hold the EAMC term: recompute them
                self._eamc_block = self._eamc_key = None
                covered = False
        elif n:
            timed = self.eamc_term is not None and self.plan_timed
            t0 = time.thread_time() if timed else 0.0
            k = min(self.matches, n)
            if n <= k and self.eamc.index_kind == "flat":  # an exact top-k of all: every entry
                times = np.full(n, len(request_ids), dtype=np.int64)
            else:
                times = self._match(layer, request_ids, k)  # [n] times matched
            key = (self.eamc.version, times.tobytes())
            if key != self._eamc_key or not covered:
                block, matched = eam_kernels.matched_row_probs(self.eamc.entries(), times, lo, hi)  # [D, E]
                self._eamc_block = block if matched else None
                self._eamc_key, covered = key, False
            # the term's host time, for _plan to weigh (None: not measured at this plan)
            self._eamc_s = time.thread_time() - t0 if timed else None
        if not covered:
            # [D, E] own + EAMC term normalised, [D] rows with any evidence
            if self._eamc_block is None:  # the own term alone: every row of the step, once a step
                self._final, self._evidence = self._own_rows()
                self._window = w0, w1 = 0, self.num_layers
            else:
                final, evidence = eam_kernels.own_plus_eamc(self._own[lo:hi], self._eamc_block)
                self._final, self._evidence = final, evidence.tolist()
                self._window = w0, w1 = lo, hi
            self._limited = None
        if not any(self._evidence[lo - w0 : hi - w0]):
            return None
        return self._final[lo - w0 : hi - w0]

    def _begin_layer(self, layer: int, request_ids: list[str]) -> None:
        """Drop the per-step state when the recorder's earlier-step EAMs or live requests changed
        (its ``epoch``: a new step), the batch changed, or ``layer`` is not after the last one."""
        epoch = self.recorder.epoch
        if epoch != self._epoch or request_ids != self._step_ids or layer <= self._last_layer:
            self._epoch, self._step_ids = epoch, list(request_ids)
            self._own = self._final = self._eamc_block = self._own_final = None
            self._eamc_key = None
            # the same batch, matched in the step just ended: the matcher resumes from that
            # step's rows (_match); else it starts from the full query
            self._resume = (
                self._match_ids is not None
                and self._match_step == self._steps - 1
                and request_ids == self._match_ids
            )
            if not self._resume:
                self._match_ids = None
            self._unmatched = []
        self._last_layer = layer

    def _match(self, layer: int, request_ids: list[str], k: int) -> np.ndarray:
        """``[n]`` how many requests have each EAMC entry among their ``k`` best matches of the
        EAM so far (prefix matching, §5.1).

        Incremental (:class:`tracer.prefix_match.PrefixMatcher`): from one routed layer to the
        next only that layer's row of each query changes, so only its cosines are recomputed
        (from the recorder's rows of those layers, ``query_rows``) and one compiled call takes
        each request's top ``k`` (``eam_kernels.match_counts``, faiss's heap); a new step or batch
        (:meth:`_begin_layer`) or a new ``k`` starts from the full query. It gives exactly the
        matches of its from-scratch form (the full query searched each layer), and was cheaper
        than one full search per layer at every shape measured (the note at the module's top).

        Across steps: when the same batch matched in the step just ended, the rows the matcher
        took in after their layer routed there already hold this step's earlier-step counts, so
        the step's first match refreshes only the others and the rows routed so far
        (``PrefixMatcher.resume_step``), then updates the current row as a fresh start does: the
        same state bit for bit as starting from the full query, without reading and matching
        every row again (the last layer, which never plans, is always among those refreshed).
        """
        rec = self.recorder
        m = self._matcher
        if m is None or m.k != k:
            m = self._matcher = PrefixMatcher(self.eamc, k=k)
            self._match_ids = None
        if self._match_ids is None or self._resume:  # the step's first match
            if self._match_ids is None:
                so_far = rec.query(request_ids, layer)  # [B, L, E]
                m.begin_step(so_far)
                self._match_ids = self._step_ids
                row = so_far[:, layer : layer + 1]
            else:  # the rows not taken in after routing in the last step, and those routed so far
                layers = sorted({*np.flatnonzero(~self._fed).tolist(), *range(layer + 1)})
                rows = self._read_rows(request_ids, layers)
                m.resume_step(layers, rows)
                i = layers.index(layer)
                row = rows[:, i : i + 1]
            m.update_rows([layer], row)
            self._fed[:] = False
            self._fed[: layer + 1] = True
        else:
            layers = [*self._unmatched, layer]  # ascending: routed in this order
            m.update_rows(layers, self._read_rows(request_ids, layers))
            self._fed[layers] = True
        self._resume = False
        self._match_step = self._steps
        self._unmatched = []
        return eam_kernels.match_counts(m.scores, k)

    def _read_rows(self, request_ids: list[str], layers: list[int]) -> np.ndarray:
        """``(B, len(layers), E)`` the recorder's rows of ``layers`` (ascending) for the batch, read
        as one span (``query_rows``) and the rows in between dropped."""
        rows = self.recorder.query_rows(request_ids, layers[0], layers[-1] + 1)  # [B, span, E]
        if len(layers) < rows.shape[1]:
            rows = rows[:, [lay - layers[0] for lay in layers]]
        return rows

    def _own_rows(self) -> tuple[np.ndarray, list[bool]]:
        """The step's own term alone normalised, every row (``[L, E]``), and which rows have any
        evidence (``[L]``): computed once per step (rows after the routed layer hold only earlier
        steps' counts; row by row the numbers of a window's computation)."""
        if self._own_final is None:
            final, evidence = eam_kernels.own_plus_eamc(self._own, self._own[:0])
            self._own_final = (final, evidence.tolist())
        return self._own_final

    def _plan_weights(self, layer: int, n: int) -> np.ndarray:
        """``proximity(layer)`` of the plan's ``n`` rows (layers ``layer + 1 ..``), ``[n]``, kept per
        ``(layer, n)``: the plan reads them at every planning layer (do not write to them)."""
        w = self._weights.get((layer, n))
        if w is None:
            w = self._weights[layer, n] = self.proximity(layer)[layer + 1 : layer + 1 + n]
        return w

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        """Plan the later layers after ``layer`` routed (§5.1); with the cost gate (ours) only
        where it decides to (``GatedPlanning._gated_routing``)."""
        if self.gate is not None:
            self._gated_routing(layer, request_ids, topk_ids)
            return
        self._plan(layer, request_ids, topk_ids)

    def _defer_match(self, layer: int, request_ids: list[str]) -> None:
        """Layer ``layer`` routed without a plan: the incremental matcher, if it runs this step,
        takes that layer's row in at its next use."""
        if self._match_ids is not None:
            self._begin_layer(layer, request_ids)
            if self._match_ids is not None:
                self._unmatched.append(layer)

    def _plan(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> bool:
        """Predict, limit, test and issue the plan of the layers after ``layer``. Returns whether
        the gate scored its candidates noted for ``layer`` (the plan's compiled call does;
        :meth:`_paying`)."""
        gate = self.gate
        self.plans += 1
        term = self.eamc_term
        # Ours: a decode plan with rows to predict and an EAMC to match asks the term's test
        # (term_value); a prefill plan, which ranks a whole prompt's routing, always computes the
        # term and is neither timed nor scored for it (as the gate times only decode plans).
        weigh = (
            term is not None
            and topk_ids.shape[0] == len(request_ids) > 0
            and layer + 1 < self.num_layers
            and len(self.eamc) > 0
        )
        with_eamc = not weigh or term.wanted(self._block_per_miss_s())
        ahead, self._ahead = self._ahead, None
        base = self._predict_rows(layer, request_ids, eamc=with_eamc)
        # [D, E] rows of layers lo .. lo + D - 1, and the router lookahead to blend into them (ours)
        base, spec = self._plan_rows(layer, base, ahead)
        lo = layer + 1
        self._last = None if base is None else (lo, base, spec)
        if base is None:
            return False
        # A later layer will need at most as many experts as this step routes (tokens x top-k):
        # keep only that many of its most likely experts, so the plan does not flood the link.
        cap = min(self.num_experts, topk_ids.size)
        if weigh and with_eamc:  # ours: the term's host time, and its candidates (term_value)
            if self._eamc_s is not None:
                term.note_host_time(self._eamc_s)
            self._note_eamc_term(term, layer, base, spec, cap)
        weights = self._plan_weights(layer, len(base))
        min_prob = self.min_prob
        if spec is None:  # the step's cached rows (_predict_rows) as they are: limit them once per step
            if self._limited is None or self._limited[0] != cap:
                self._limited = (cap, _limit(self._final, cap, self.min_prob))
            w0 = self._window[0]
            # already limited: weights only
            base, cap, min_prob = self._limited[1][lo - w0 : lo - w0 + len(base)], 0, 0.0
        if gate is None:  # the paper's plan: every candidate, best first
            scores = eam_kernels.limit_scores(self._blended(base, spec), cap, min_prob, weights)[1]
            self.issue(scores, first_layer=lo)
            return False
        # ours: the candidates that pay (gating, gate)
        plan = self._paying(gate, layer, lo, base, spec, cap, min_prob, weights, topk_ids)
        if plan is not None:  # None: nothing pays and nothing of ours is queued (on-demand)
            self.issue_ranked(*plan)
        return True

    def end_step(self) -> None:
        """A step ended: the matcher may resume from it in the next (:meth:`_match`); the gate's
        figures and the trial's measure follow (``TrialArms.end_step``)."""
        self._steps += 1
        super().end_step()


def _limit(rows: np.ndarray, cap: int, min_prob: float) -> np.ndarray:
    """``rows [D, E]`` (float32) with entries below ``min_prob`` and outside each row's ``cap``
    largest zeroed (``eam_kernels.limit_scores``)."""
    return eam_kernels.limit_scores(rows, cap, min_prob, np.ones(len(rows)))[0]


def _row_probs(x: np.ndarray) -> np.ndarray:
    """Each row of ``x [L, E]`` (non-negative) scaled to sum to 1, as float32; zero rows stay zero
    (``eam_kernels.row_probs``)."""
    return eam_kernels.row_probs(np.ascontiguousarray(x, dtype=np.float32))
