"""Activation-aware prefetching: match the running requests against the EAMC (MoE-Infinity §5.1).

NOTE: after MoE layer ``l`` routes, each running request's EAM so far (its request EAM plus this
iteration's rows up to ``l``; the recorder builds it) is matched against the EAMC by cosine
similarity with prefix matching (rows L2-normalised, unseen rows zero, so the score is the sum of
per-layer cosines over seen layers). The top matches of all running requests are summed and
row-normalised into per-expert activation probabilities for every later layer, weighted by layer
proximity ``1 - (i - l) / L`` (Figure 7), and the best experts not yet resident are handed to the
I/O queue as a re-prioritised plan (at most ``tokens x top-k`` experts per later layer: goal (ii)
of §5.1, do not spend the link on experts that cannot all be used). The batch's own EAM so far is
added to the matches (skewed reuse, §3.1), so a cold EAMC still predicts; the EAMC fills online
as requests finish, or is loaded from a file saved by an earlier run.

With ``lookahead >= 1`` (our addition, not in the paper) the plan for the next ``lookahead`` layers
also uses the router lookahead (``moe_runtime.layers.router_lookahead``: those layers' routers
applied to the current residual stream, Mixtral-Offloading's speculative loading): its expected
token counts, row-normalised, are added with weight ``lookahead_weight`` to the EAMC probabilities
of those layers. The EAMC alone still plans the layers further away; without lookahead scores (the
simulator replays routing only) the policy is the paper's.

In the runtime the EAMC term is weighed (``moe_runtime.prefetch.term_value``, ours): a plan
computes it only while its measured gain (extra used next-layer candidates times the blocking
per miss) beats its measured host time, and as a probe at doubling intervals otherwise; the
matcher catches up on the rows it skipped at its next use. The simulator never skips it.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from moe_runtime.errors import ConfigError
from moe_runtime.prefetch import kernels
from moe_runtime.prefetch.base import PrefetchPolicy
from moe_runtime.prefetch.gate import ModeTrial, PrefetchGate, clock, routed_ids
from moe_runtime.prefetch.run_clock import RunClock
from moe_runtime.prefetch.term_value import TermValue
from tracer.prefix_match import PrefixMatcher

# Matching is always incremental (EAMPrefetch._match). A full EAMC search per layer ran below
# 512k multiply-adds (B * n * L * E) until the incremental matcher beat it at every shape measured
# (bench overhead's workload, _match p50 in us, full vs incremental, batch B, n EAMC entries):
# qwen3-30b-a3b B=1 n=32: 56-65 vs 36, B=2 n=32: 80 vs 61; mixtral-8x7b B=1 n=32: 42 vs 33,
# n=256: 38 vs 35, n=1000: 50 vs 37; switch-base-128 B=1 n=32: 34 vs 31, B=4: 50 vs 38;
# deepseek-v3 B=1 n=32: 80 vs 38; tools/sim_fingerprint.py: 0 of 40 runs differ.
# The policy's modes (set_arm): prefetching, caching alone, on-demand + LRU.
MODES = ("prefetch", "cache", "lean")
# The runtime trial's default arms (gate.ModeTrial), the prefetching one first, the reference last.
# ``lean`` is left out: once the ``eam-reuse`` cache weighed decode routing above the prompt's
# (``moe_runtime.buffer.policies.PREFILL_WEIGHT``) it beat LRU's hit rate in every replayed setting
# (``tools/cache_headroom.py``), and the windows spent exploring LRU cost more than they found:
# the two arms against the three, same code otherwise, bench policies' grid workload, 3 repeats,
# were faster at 7 of 8 (link, batch, buffer) points and within the spread at the eighth.
ARMS = ("prefetch", "cache")
_NO_USE = np.zeros(0)  # no victim-use term (EAMPrefetch._victim_use)
# The share of the runtime's planning layers whose host time is measured (thread CPU time, for the
# gate's and the EAMC term's running means): the clock is a system call, 1.6 us p50 per read in
# ``bench overhead``'s planning layers at batch 16, two reads per plan and two per router
# lookahead. Drawn at random, so the plans measured do not fall on the same layers every step.
HOST_SAMPLE = 0.25


class EAMPrefetch(PrefetchPolicy):
    """Args (beyond the base): eamc: the EAM collection to match against; matches: top matches
    per request (default 16); min_prob: experts below this activation probability are not
    prefetched (default 0); own_weight: weight of the batch's own EAM so far in the prediction
    (default 1); cost_aware: issue only the candidates whose expected gain beats their expected
    cost (``moe_runtime.prefetch.gate``; default True); probe_every: while the last plan's paying
    candidates did not win back its host time (in the simulator: while it kept nothing; the policy
    is on-demand then), predict only at every ``probe_every``-th layer (default 4), which keeps
    the gate's precision current at a quarter of the host work; trial: in the runtime (not the
    simulator), with ``cost_aware``, also run the measured comparison of prefetching and caching
    alone (:class:`moe_runtime.prefetch.gate.ModeTrial`; default True); trial_arms: its arms, a
    subset of :data:`MODES` in that order with ``prefetch`` first and at least two (default
    :data:`ARMS`; add ``lean``, on-demand + LRU, to measure LRU as well); weigh_eamc: in the
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
        kernels.warm()
        self.matches = matches
        self.min_prob = min_prob
        self.own_weight = own_weight
        if lookahead < 0:
            raise ConfigError(f"--router-lookahead must be >= 0, got {lookahead}")
        if lookahead_weight < 0:
            raise ConfigError(f"router lookahead weight must be >= 0, got {lookahead_weight}")
        self.lookahead_depth = lookahead  # the model computes router lookahead scores when > 0
        if lookahead > 0 and kwargs.get("depth") is None:
            self.depth = lookahead  # plan only the layers the lookahead sees (docs/results.md)
        self.lookahead_weight = lookahead_weight
        self._ahead: tuple[int, np.ndarray] | None = None  # (layer, [D, E]) of the current layer
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
        # gain/cost test of every candidate (moe_runtime.prefetch.gate); None = issue every plan
        self.gate = PrefetchGate(self.num_layers, self.num_experts, self.depth) if cost_aware else None
        self._queued = True  # the last plan handed to the buffer was not empty
        self._planning = True  # plan every layer (else only every probe_every-th one probes)
        if probe_every < 1:
            raise ConfigError(f"eam probe_every must be >= 1, got {probe_every}")
        self.probe_every = probe_every
        self.plans = 0  # layers planned (predicted and tested), for the overhead figures
        # The runtime (wall clock = compute clock) times each planning layer (thread CPU time)
        # for the gate; the simulator, whose clock is not the host's, does not (its results
        # stay deterministic).
        self._timed = getattr(self.buffer, "now", None) is None
        self._lookahead_s = 0.0  # the router lookahead's host time of the layer about to route
        # whether the next plan's host time (and its router lookahead's) is measured (HOST_SAMPLE)
        self.plan_timed = True
        self._sampler = random.Random(0)
        # the runtime's measured comparison of its modes (gate.ModeTrial); None in the simulator
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
        self._p_use: tuple[np.ndarray, int, np.ndarray] | None = None  # (own term, T, [L * E] p)
        # kernels.least_used's sort of that p (reset with it): [L * E] order, [3] heap work so far,
        # sorted, plans still expected in the step (set at each plan)
        self._use_order = np.zeros(self.num_layers * self.num_experts, dtype=np.int32)
        self._use_state = np.zeros(3, dtype=np.int64)
        self._no_ahead = np.zeros((0, self.num_experts), dtype=np.float32)  # a plan without lookahead
        # the gate's plan, written by kernels.limit_gate_plan (at most depth x E keys)
        self._plan_keys = np.zeros(self.depth * self.num_experts, dtype=np.int64)
        self._plan_priorities = np.zeros(self.depth * self.num_experts)
        self._weights: dict[tuple[int, int], np.ndarray] = {}  # (layer, rows) -> [rows] (_plan_weights)
        # the EAMC term's measured gain against its host time (term_value); None: always computed
        self.eamc_term = TermValue(probe_every) if cost_aware and self._timed and weigh_eamc else None
        # host seconds of the EAMC term in the latest prediction (with eamc_term; None: not measured)
        self._eamc_s: float | None = None
        self._step_link: tuple[float, np.ndarray] | None = None  # the step's gate terms (_link_terms)

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
                block, matched = kernels.matched_row_probs(self.eamc.entries(), times, lo, hi)  # [D, E]
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
                final, evidence = kernels.own_plus_eamc(self._own[lo:hi], self._eamc_block)
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
        each request's top ``k`` (``kernels.match_counts``, faiss's heap); a new step or batch
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
        return kernels.match_counts(m.scores, k)

    def _read_rows(self, request_ids: list[str], layers: list[int]) -> np.ndarray:
        """``(B, len(layers), E)`` the recorder's rows of ``layers`` (ascending) for the batch, read
        as one span (``query_rows``) and the rows in between dropped."""
        rows = self.recorder.query_rows(request_ids, layers[0], layers[-1] + 1)  # [B, span, E]
        if len(layers) < rows.shape[1]:
            rows = rows[:, [lay - layers[0] for lay in layers]]
        return rows

    def observe_lookahead(self, layer: int, scores: np.ndarray) -> None:
        """Router lookahead scores ``[D, E]`` of MoE layers ``layer + 1 .. layer + D``, handed over
        by the model right before :meth:`after_routing` of ``layer``."""
        self._ahead = (layer, scores)

    def blend_lookahead(self, layer: int, probs: np.ndarray | None) -> np.ndarray | None:
        """``probs [L, E]`` with the router lookahead of ``layer`` blended into its next layers
        (consumes the lookahead :meth:`observe_lookahead` handed over)."""
        lo = layer + 1
        rows = None if probs is None else probs[lo : min(self.num_layers, lo + self.depth)]
        ahead, self._ahead = self._ahead, None
        out = self._blend_ahead(layer, rows, ahead)
        if out is rows:
            return probs
        full = np.zeros((self.num_layers, self.num_experts), np.float32) if probs is None else probs.copy()
        full[lo : lo + len(out)] = out
        return full

    def _plan_rows(
        self, layer: int, rows: np.ndarray | None, ahead: tuple[int, np.ndarray] | None
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The plan's rows ``[D, E]`` (layers ``layer + 1 ..``; zeros where ``rows`` is None but a
        lookahead is there) and the router lookahead ``[d, E]`` (float32, contiguous) to blend
        into the first ``d`` of them, or None (none for ``layer``, or weight 0): ``rows`` itself
        then. ``ahead``: ``(layer, [D, E] scores)`` as :meth:`observe_lookahead` keeps it, or
        None. The blend itself (``kernels.blend``) runs inside the plan's compiled call."""
        if ahead is None or ahead[0] != layer or self.lookahead_weight == 0:
            return rows, None
        n = min(self.num_layers, layer + 1 + self.depth) - layer - 1  # rows of the plan
        d = min(self.lookahead_depth, n, len(ahead[1]))
        if d <= 0:
            return rows, None
        base = np.zeros((n, self.num_experts), np.float32) if rows is None else rows
        spec = ahead[1]
        if len(spec) != d or spec.dtype != np.float32 or not spec.flags.c_contiguous:
            spec = np.ascontiguousarray(spec[:d], dtype=np.float32)
        return base, spec

    def _plan_weights(self, layer: int, n: int) -> np.ndarray:
        """``proximity(layer)`` of the plan's ``n`` rows (layers ``layer + 1 ..``), ``[n]``, kept per
        ``(layer, n)``: the plan reads them at every planning layer (do not write to them)."""
        w = self._weights.get((layer, n))
        if w is None:
            w = self._weights[layer, n] = self.proximity(layer)[layer + 1 : layer + 1 + n]
        return w

    def _blended(self, rows: np.ndarray, spec: np.ndarray | None) -> np.ndarray:
        """``rows [D, E]`` with the lookahead ``spec [d, E]`` of :meth:`_plan_rows` blended in
        (``kernels.blend``; a new array), or ``rows`` itself without one."""
        return rows if spec is None else kernels.blend(rows, spec, self.lookahead_weight)

    def _blend_ahead(
        self, layer: int, rows: np.ndarray | None, ahead: tuple[int, np.ndarray] | None
    ) -> np.ndarray | None:
        """The plan's rows ``rows [D, E]`` (layers ``layer + 1 ..``) with the router lookahead
        ``ahead`` (``(layer, [D, E] scores)``, or None) blended in: ``rows`` itself without a
        lookahead for ``layer``, else a new array."""
        rows, spec = self._plan_rows(layer, rows, ahead)
        return None if rows is None else self._blended(rows, spec)

    @property
    def last_probs(self) -> np.ndarray | None:
        """``[L, E]`` probabilities of the latest plan (rows it covers; others 0), or None."""
        if self._last is None:
            return None
        lo, rows, spec = self._last
        prob = np.zeros((self.num_layers, self.num_experts), np.float32)
        prob[lo : lo + len(rows)] = self._blended(rows, spec)
        return prob

    @property
    def idle(self) -> bool:  # type: ignore[override]
        """Whether the trial runs an arm without plans (caching alone or lean): the model then
        hands only layer 0's routing over (the step's start, for the trial) and computes no
        router lookahead (``PrefetchPolicy.idle``)."""
        pinned = self._pinned
        if pinned is not None:
            return pinned != "prefetch"
        return self.trial is not None and not self.trial.on

    def wants_lookahead(self, layer: int) -> bool:
        """Whether :meth:`after_routing` of ``layer`` will plan, so the model should compute the
        router lookahead for it (it skips that work while the policy is on-demand)."""
        if self.idle:  # caching alone or lean: no plans
            return False
        return self.gate is None or self._planning or layer % self.probe_every == 0

    def note_lookahead_time(self, seconds: float) -> None:
        """The router lookahead of the layer about to route took ``seconds`` of the compute
        thread (``moe_runtime.layers.router_lookahead``); charged to that layer's plan."""
        self._lookahead_s += seconds

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        gate = self.gate
        if self._step_t0 is None and self._run_clock is not None:  # the step's first routed layer
            self._step_t0 = self._run_clock.wall()
        if gate is not None:
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
                if self._match_ids is not None:  # the incremental matcher takes this row later
                    self._begin_layer(layer, request_ids)
                    if self._match_ids is not None:
                        self._unmatched.append(layer)
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
            return
        self._plan(layer, request_ids, topk_ids)

    def _plan(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> bool:
        """Predict, limit, test and issue the plan of the layers after ``layer``. Returns whether
        the gate scored its candidates noted for ``layer`` (the plan's compiled call does;
        :meth:`_paying`)."""
        gate = self.gate
        self.plans += 1
        term = self.eamc_term
        # A decode plan with rows to predict and an EAMC to match asks the term's test
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
        # [D, E] rows of layers lo .. lo + D - 1, and the router lookahead to blend into them
        base, spec = self._plan_rows(layer, base, ahead)
        lo = layer + 1
        self._last = None if base is None else (lo, base, spec)
        if base is None:
            return False
        # A later layer will need at most as many experts as this step routes (tokens x top-k):
        # keep only that many of its most likely experts, so the plan does not flood the link.
        cap = min(self.num_experts, topk_ids.size)
        if weigh and with_eamc:
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
        if gate is None:
            scores = kernels.limit_scores(self._blended(base, spec), cap, min_prob, weights)[1]
            self.issue(scores, first_layer=lo)
            return False
        plan = self._paying(gate, layer, lo, base, spec, cap, min_prob, weights, topk_ids)
        if plan is not None:  # None: nothing pays and nothing of ours is queued (on-demand)
            self.issue_ranked(*plan)
        return True

    def _note_eamc_term(
        self, term: TermValue, layer: int, base: np.ndarray, spec: np.ndarray | None, cap: int
    ) -> None:
        """Note for ``term`` (:mod:`moe_runtime.prefetch.term_value`) the next layer's candidates
        of this plan (``base [D, E]``, the EAMC term in, with the router lookahead ``spec [d,
        E]`` of :meth:`_plan_rows` blended in) and of the plan without the EAMC term (the step's
        own term alone, normalised as :meth:`_predict_rows` does, blended with the same
        lookahead): the ``cap`` best experts of each that the buffer does not hold, in one
        compiled call (``kernels.term_candidates``). Nothing before the step's own term exists."""
        if self._own is None:
            return
        lo, E = layer + 1, self.num_experts
        own = self._own_rows()[0][lo : lo + 1]
        held = self.buffer.held[lo * E : (lo + 1) * E]
        ahead = self._no_ahead if spec is None else spec
        term.note(lo, *kernels.term_candidates(base, own, ahead, self.lookahead_weight, held, cap))

    def _own_rows(self) -> tuple[np.ndarray, list[bool]]:
        """The step's own term alone normalised, every row (``[L, E]``), and which rows have any
        evidence (``[L]``): computed once per step (rows after the routed layer hold only earlier
        steps' counts; row by row the numbers of a window's computation)."""
        if self._own_final is None:
            final, evidence = kernels.own_plus_eamc(self._own, self._own[:0])
            self._own_final = (final, evidence.tolist())
        return self._own_final

    def _block_per_miss_s(self) -> float:
        """Seconds one avoided miss saves: the gate's running blocking per miss ``b``, before
        any miss one copy's link time."""
        if self.gate is None:
            return self._transfer_s()
        return self._link_terms()[0]

    def _link_terms(self) -> tuple[float, np.ndarray]:
        """The step's ``(b, terms)`` for the gate: ``b`` (:meth:`_block_per_miss_s`) and
        ``kernels.gate_terms`` of the lookahead weight, ``b``, ``q``, ``t`` (:meth:`_transfer_s`),
        the gate's ``force_open``, the buffer's slots, the gate's idle copies,
        ``PrefetchGate.idle_save`` and ``h``. Read at the step's first plan and kept until its
        end: the gate's figures change only at a step's end (``PrefetchGate.update_link``,
        :meth:`end_step`), the simulator's link time never, and the runtime's measured copy time
        is a running mean that one step's copies barely move."""
        terms = self._step_link
        if terms is None:
            gate, t = self.gate, self._transfer_s()
            b = t if gate.block_per_miss_s is None else gate.block_per_miss_s
            packed = kernels.gate_terms(
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
        its candidates for their layers (``kernels.limit_gate_plan``)."""
        terms = self._link_terms()[1]
        # the plans still expected in this step, this one included (the last layer never plans):
        # least_used sorts the victims' use once when they would make its heap passes dearer
        every = 1 if self._planning else self.probe_every
        self._use_state[2] = (self.num_layers - 2 - layer) // every + 1
        # the predictor's candidates a prefetch would copy, ranked within their row, and those of
        # them that pay
        figures, noted, noted_n = gate.plan_state()
        m, net, scored = kernels.limit_gate_plan(
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
        steps any more), and the prefetch bar is not weighed. ``tools/policy_ab.py``'s ``eam@<arm>``
        rows and ``tools/lean_cost.py`` compare the arms this way.

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

    def end_step(self) -> None:
        self._steps += 1
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
                # CPU time; per expert lookup, what the batch asked for (see gate.ModeTrial)
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


def _limit(rows: np.ndarray, cap: int, min_prob: float) -> np.ndarray:
    """``rows [D, E]`` (float32) with entries below ``min_prob`` and outside each row's ``cap``
    largest zeroed (``kernels.limit_scores``)."""
    return kernels.limit_scores(rows, cap, min_prob, np.ones(len(rows)))[0]


def _row_probs(x: np.ndarray) -> np.ndarray:
    """Each row of ``x [L, E]`` (non-negative) scaled to sum to 1, as float32; zero rows stay zero
    (``kernels.row_probs``)."""
    return kernels.row_probs(np.ascontiguousarray(x, dtype=np.float32))
