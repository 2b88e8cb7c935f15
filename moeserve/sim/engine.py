"""Replay a workload through the runtime's scheduler, tracer hooks, policies and buffer state machine.

NOTE: one simulated engine step mirrors ``LLMEngine.step`` and ``moe_block``. The runtime's own
:class:`~moe_runtime.engine.scheduler.Scheduler` picks the step's sequences and token counts (a
prompt is prefilled in one step unless it exceeds the token budget). Per MoE layer, in the
runtime's order: the dense part runs (``CostModel.layer_s``), the router's top-k ids come from
the trace, then ``recorder.record`` -> ``buffer.after_routing`` -> ``buffer.start_layer`` (hits
pinned, misses queued) -> ``prefetcher.after_routing`` (which may re-plan the I/O queue) ->
``buffer.finish_layer``: resident experts compute first while
transfers proceed, each missing one computes as it lands, and the time compute waits is blocking
time. After the last layer: the step's fixed cost (LM head, sampling), ``recorder.end_step``,
``prefetcher.end_step``, then finished requests commit their EAMs to the EAMC
(``recorder.finish``). Requests run in static groups of ``batch`` (``moeserve bench policies``
does the same): a group's requests start together and leave as they finish; the next group starts
when the whole group is done. TPOT is measured per group as the mean step time after the first
step, and reported as the median over groups, exactly as the benchmark does.

Tokens whose routing is missing at a layer (``-1`` in imported logs) skip that layer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from moe_runtime.engine.request import SamplingParams, Sequence
from moe_runtime.engine.scheduler import ScheduledSeq, Scheduler
from moe_runtime.prefetch import OracleSchedule, make_prefetch_policy
from moe_runtime.stats import ExpertStats
from moeserve.sim.buffer import SimBuffer
from moeserve.sim.cost import CostModel
from moeserve.sim.hybrid import HybridConfig, SimPlacer, StepTally, preload_fixed
from moeserve.sim.workload import SimRequest
from tracer.eamc import DEFAULT_CAPACITY


@dataclass(slots=True)
class SimConfig:
    """Simulation settings (runtime flags of the same names).

    Attributes:
        slots: expert slots in total (split over devices as the engine does: ``ceil(slots / n)``).
        num_devices: device partitions (hash placement, MoE-Infinity §5.3).
        batch: requests per static group (the engine's ``max_batch_size``).
        max_num_batched_tokens: token budget per step.
        prefetch_depth: later layers a prefetch plan covers (None = all).
        eamc_capacity: EAMC entries for the ``eam`` policies.
        host_time_scale: charge this multiple of the measured wall time of the tracer and policy
            hooks to the simulated compute thread (calibration: 1.0; default 0: deterministic).
        layer_jitter_s: standard deviation (seconds) of each MoE layer's dense time, drawn per
            layer from a normal distribution (seeded by ``jitter_seed``, the same draws for every
            policy; times below zero clip to zero). A runtime's layer times jitter, and a policy
            near a timing threshold (one more copy landing before a layer runs) lands between its
            two outcomes there; the deterministic default (0) takes one side.
        lookahead_precision: the router lookahead modelled as a predictor (``--router-lookahead``,
            which needs hidden states a routing trace does not hold): entry ``d - 1`` is its
            per-token top-k precision ``d`` MoE layers ahead, as ``moeserve bench lookahead``
            measures it. Each token's guess keeps each of its real experts with that chance and
            otherwise names a random expert it did not choose (seeded by ``lookahead_seed``); the
            ``eam`` prefetch gets the guesses' counts as its lookahead scores. Empty: no lookahead.
        hybrid: hybrid expert execution (``--expert-compute``) and the hybrid bound; None: every
            miss copied and no bound.
    """

    slots: int
    num_devices: int = 1
    batch: int = 1
    max_num_batched_tokens: int = 4096
    prefetch_depth: int | None = None
    eamc_capacity: int = DEFAULT_CAPACITY
    host_time_scale: float = 0.0
    layer_jitter_s: float = 0.0
    jitter_seed: int = 0
    lookahead_precision: tuple[float, ...] = ()
    lookahead_seed: int = 0
    hybrid: HybridConfig | None = None


@dataclass(slots=True)
class PolicyRun:
    """What one policy did on the eval part (counters are eval-only deltas)."""

    label: str
    prefetch: str
    cache: str
    slots: int
    tokens: int
    steps: int
    tpot_s: float
    sim_seconds: float
    stats: dict[str, Any]
    wall_s: float
    sim_lookups: int  # lookups simulated in this run, warm part included (speed measurement)
    access_log: list[tuple[int, tuple[int, ...]]] | None = field(default=None, repr=False)
    # hybrid execution and the bound (moeserve.sim.hybrid.StepTally.summary, plus the CPU's
    # seconds); None without SimConfig.hybrid
    hybrid: dict[str, Any] | None = None

    @property
    def lookups(self) -> int:
        return int(self.stats["lookups"])

    @property
    def hit_rate(self) -> float:
        return self.stats["hits"] / self.lookups if self.lookups else 0.0

    @property
    def blocking_s_per_token(self) -> float:
        return self.stats["blocking_s"] / self.tokens if self.tokens else 0.0

    @property
    def bytes_per_token(self) -> float:
        moved = self.stats["demand_bytes"] + self.stats["prefetch_bytes"]
        return moved / self.tokens if self.tokens else 0.0


def stats_delta(before: ExpertStats, after: ExpertStats) -> dict[str, Any]:
    """``after - before`` of every total in :meth:`ExpertStats.summary` (unrounded blocking)."""
    a, b = after.summary(), before.summary()
    out = {k: a[k] - b[k] for k in a if k != "hit_rate"}
    out["blocking_s"] = after.total_blocking_s - before.total_blocking_s
    return out


class Simulator:
    """Runs policies over workloads at one model shape, cost model and buffer size.

    Args:
        num_layers, num_experts, top_k: the trace's ``L``, ``E``, ``k``.
        expert_bytes: bytes per expert (byte counters only; time comes from ``cost``).
        cost: the cost model.
        config: buffer and batching settings.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        expert_bytes: int,
        cost: CostModel,
        config: SimConfig,
    ) -> None:
        self.L, self.E, self.k = num_layers, num_experts, top_k
        self.expert_bytes = expert_bytes
        self.cost = cost
        self.config = config

    def run(
        self,
        prefetch: str,
        cache: str,
        warm: list[SimRequest],
        evals: list[SimRequest],
        oracle_log: list[tuple[int, tuple[int, ...]]] | None = None,
        record_log: bool = False,
        label: str | None = None,
        lookahead: int | None = None,
    ) -> PolicyRun:
        """Warm (skipped for the oracle, as in ``bench policies``), then measure ``evals``.

        ``lookahead``: router lookahead layers of an ``eam`` prefetch (None: as many as
        ``config.lookahead_precision`` has; 0: none, the paper's plan).

        Raises:
            ConfigError: unknown policy name, or the oracle without ``oracle_log``.
        """
        # NOTE: the policies' small matrix products must not wake a multi-threaded BLAS pool: on
        # a busy 2-core host its spinning threads made a 256-request run 4x slower (26 vs 6.5 CPU-s).
        with threadpool_limits(limits=1, user_api="blas"):
            return self._run(prefetch, cache, warm, evals, oracle_log, record_log, label, lookahead)

    def _run(
        self,
        prefetch: str,
        cache: str,
        warm: list[SimRequest],
        evals: list[SimRequest],
        oracle_log: list[tuple[int, tuple[int, ...]]] | None,
        record_log: bool,
        label: str | None,
        lookahead: int | None = None,
    ) -> PolicyRun:
        t_wall = time.perf_counter()
        state = self.make_state(prefetch, cache, oracle_log, lookahead)
        buf = state.buffer
        if oracle_log is None:
            self._run_batches(state, warm)
        if record_log:
            buf.access_log = []
        st0 = buf.stats.snapshot()
        t0 = buf.now
        hy = self.config.hybrid
        if hy is not None:
            state.tally = StepTally(hy.bound_miss_s, hy.bound_hit_s)
        tpots, steps = self._run_batches(state, evals)
        hybrid = None
        if state.tally is not None:
            st = buf.stats
            hybrid = {
                "mode": hy.mode,
                "threads": hy.threads if hy.mode != "device" else 0,
                **state.tally.summary(),
                "cpu_expert_s": st.cpu_expert_s - st0.cpu_expert_s,
                "cpu_wait_s": st.cpu_wait_s - st0.cpu_wait_s,
                "cpu_avoided_bytes": st.cpu_avoided_bytes - st0.cpu_avoided_bytes,
            }
        return PolicyRun(
            label or f"{prefetch}+{cache}",
            prefetch,
            cache,
            buf.num_slots,
            sum(r.output_tokens for r in evals),
            steps,
            statistics.median(tpots) if tpots else 0.0,
            buf.now - t0,
            stats_delta(st0, buf.stats),
            time.perf_counter() - t_wall,
            buf.stats.total_lookups,
            buf.access_log,
            hybrid,
        )

    def make_state(
        self,
        prefetch: str,
        cache: str,
        oracle_log: list[tuple[int, tuple[int, ...]]] | None = None,
        lookahead: int | None = None,
    ) -> RunState:
        """The live objects of one run, built as ``LLMEngine.__init__`` builds them: a tracer
        recorder with an EAMC only for the ``eam`` policies, the buffer with the cache policy, the
        prefetch policy from the runtime's registry, the oracle schedule when a log is given.

        Raises:
            ConfigError: unknown policy name, or an oracle policy without ``oracle_log``.
        """
        cfg = self.config
        hy = cfg.hybrid
        mode = "device" if hy is None else hy.mode
        if mode == "cpu":  # a fixed resident set: nothing to prefetch or evict (as the engine)
            prefetch, cache = "on-demand", "lru"
        context: dict[str, Any] = {}
        if oracle_log is not None:
            context["oracle"] = OracleSchedule(oracle_log, self.E)
        recorder = eamc = None
        if prefetch.startswith("eam") or cache.startswith("eam"):  # as the engine (_default_recorder)
            from tracer.eamc import EAMC
            from tracer.recorder import RequestRecorder

            eamc = EAMC(self.L, self.E, capacity=cfg.eamc_capacity)
            recorder = RequestRecorder(self.L, self.E, self.k, eamc=eamc)
        precision = cfg.lookahead_precision
        depth = len(precision) if lookahead is None else min(lookahead, len(precision))
        if prefetch == "eam" and depth > 0:
            context["lookahead"] = depth  # the engine's --router-lookahead
        per_device = -(-min(cfg.slots, self.L * self.E) // cfg.num_devices)
        buf = SimBuffer(
            self.L, self.E, per_device, cfg.num_devices, self.expert_bytes, self.cost.transfer_s, cache,
            {"recorder": recorder, **context}, self.cost.wake_s,
        )  # fmt: skip
        prefetcher = make_prefetch_policy(
            prefetch, buffer=buf, num_layers=self.L, num_experts=self.E, top_k=self.k,
            recorder=recorder, depth=cfg.prefetch_depth, eamc=eamc, **context,
        )  # fmt: skip
        state = RunState(buf, prefetcher, recorder)
        if mode != "device" and not buf.all_resident:
            if hy.cpu is None:
                raise ValueError("hybrid execution needs a CPU cost (HybridConfig.cpu)")
            if mode == "cpu":
                preload_fixed(buf)
            # the runtime's pool: every thread on one expert at a time, one lane
            buf.placer = SimPlacer(buf, mode, 1, hy.cpu, self.cost.expert_s, self.expert_bytes)
            state.gate = getattr(prefetcher, "gate", None)
        if "lookahead" in context:
            state.ahead = (np.asarray(precision[:depth]), np.random.default_rng(cfg.lookahead_seed))
        if cfg.layer_jitter_s > 0:
            state.jitter = np.random.default_rng(cfg.jitter_seed)
        return state

    # ------------------------------------------------------------------ steps
    def _run_batches(self, state: RunState, reqs: list[SimRequest]) -> tuple[list[float], int]:
        """Run ``reqs`` in static groups; returns per-group TPOT (s) and the number of steps."""
        cfg, buf, recorder = self.config, state.buffer, state.recorder
        params = SamplingParams(max_tokens=1 << 30, temperature=0, ignore_eos=True)
        tpots: list[float] = []
        n_steps = 0
        tally, st = state.tally, buf.stats
        for i in range(0, len(reqs), cfg.batch):
            sched = Scheduler(cfg.batch, cfg.max_num_batched_tokens)
            for j, r in enumerate(reqs[i : i + cfg.batch]):
                rid = f"{i + j}:{r.request_id}"
                state.by_id[rid] = r
                sched.add(Sequence(rid, [0] * r.num_prefill, params, r.task))
                if recorder is not None:
                    recorder.begin_request(rid, r.num_prefill, r.task)
            times: list[float] = []
            first = True
            while sched.has_unfinished():
                scheduled = sched.schedule()
                t0 = buf.now
                if tally is not None:
                    by_id = state.by_id
                    prefill = any(s.seq.num_computed < by_id[s.seq.request_id].num_prefill for s in scheduled)
                    before = sum(st.lookups), sum(st.hits), sum(st.cpu_experts)
                dense_s = self._step(state, scheduled)
                n_steps += 1
                if not first:
                    times.append(buf.now - t0)
                if tally is not None:
                    after = sum(st.lookups), sum(st.hits), sum(st.cpu_experts)
                    tally.step(prefill, *(a - b for a, b in zip(after, before)), dense_s, first)
                first = False
                for s in scheduled:
                    seq = s.seq
                    seq.num_computed += s.num_new
                    if seq.num_computed >= state.by_id[seq.request_id].num_rows:
                        sched.finish(seq)
                        del state.by_id[seq.request_id]
                        if recorder is not None:
                            recorder.finish(seq.request_id)
            tpots.append(sum(times) / max(1, len(times)))
            if tally is not None:
                tally.end_group()
        return tpots, n_steps

    def _step(self, state: RunState, scheduled: list[ScheduledSeq]) -> float:
        """One engine step over ``scheduled`` (see the module note); returns the seconds of its
        dense part (every layer's and the step's fixed cost)."""
        buf, recorder, prefetcher, cost = state.buffer, state.recorder, state.prefetcher, self.cost
        rids, ids_parts, w_parts, prefill_parts, counts_new = [], [], [], [], []
        ctx = 0
        for s in scheduled:
            r = state.by_id[s.seq.request_id]
            start, n = s.seq.num_computed, s.num_new
            rids.append(s.seq.request_id)
            ids_parts.append(r.ids[start : start + n])
            w_parts.append(r.weights[start : start + n])
            prefill_parts.append(np.arange(start, start + n) < r.num_prefill)
            counts_new.append(n)
            ctx += start + n
        ids = ids_parts[0] if len(ids_parts) == 1 else np.concatenate(ids_parts)  # [T, L, k]
        weights = w_parts[0] if len(w_parts) == 1 else np.concatenate(w_parts)
        token_seq = np.repeat(np.arange(len(rids), dtype=np.int64), counts_new)  # [T]
        token_prefill = np.concatenate(prefill_parts)  # [T]
        missing = (ids < 0).any(axis=(0, 2)).tolist()  # [L] layers with unrecorded tokens
        needed, counts = _layer_counts(ids, self.E)
        layer_s = cost.layer_s(ids.shape[0], ctx)
        dense = [layer_s] * self.L
        if state.jitter is not None:
            dense = np.maximum(
                layer_s + state.jitter.normal(0.0, self.config.layer_jitter_s, self.L), 0.0
            ).tolist()
        expert_times = cost.experts_s(counts).tolist()  # [L][E] seconds per expert
        scale = self.config.host_time_scale
        wants_lookahead = getattr(prefetcher, "wants_lookahead", lambda layer: True)
        # each layer's ids and weights [T, k] contiguous, as the runtime's host copy hands them over
        ids_by_layer = np.ascontiguousarray(ids.transpose(1, 0, 2))  # [L, T, k]
        weights_by_layer = np.ascontiguousarray(weights.transpose(1, 0, 2)) if recorder is not None else None
        for layer in range(self.L):
            buf.now += dense[layer]
            lid = ids_by_layer[layer]
            keep = (lid >= 0).all(axis=1) if missing[layer] else None
            if keep is not None:
                lid = lid[keep]
            t_host = time.perf_counter() if scale else 0.0
            if recorder is not None:
                lw, lseq, lpre = weights_by_layer[layer], token_seq, token_prefill
                if keep is not None:
                    lw, lseq, lpre = lw[keep], lseq[keep], lpre[keep]
                recorder.record(layer, rids, lseq, lpre, lid, lw)
            buf.after_routing(layer, rids, lid)
            if scale:
                buf.now += scale * (time.perf_counter() - t_host)
            run = buf.start_layer(layer, needed[layer], counts[layer])  # demand queued before the plan
            buf.now += cost.plan_s
            if scale:
                t_host = time.perf_counter()
            if state.ahead is not None:
                # drawn at every layer (the same random stream whatever the policy does); handed
                # over, as the runtime's model computes it, only when the policy wants it
                ahead = _lookahead_scores(ids, layer, self.E, *state.ahead)
                if wants_lookahead(layer):
                    prefetcher.observe_lookahead(layer, ahead)
            prefetcher.after_routing(layer, rids, lid)
            if scale:
                buf.now += scale * (time.perf_counter() - t_host)
            buf.finish_layer(layer, run, expert_times[layer].__getitem__)
        buf.now += cost.step_fixed_s
        if recorder is not None:
            recorder.end_step()
        if state.gate is not None:  # hybrid: a miss costs at most the CPU's time for it (the gate's b)
            state.gate.cpu_miss_s = buf.placer.cpu_miss_seconds
        prefetcher.end_step()
        return sum(dense) + cost.step_fixed_s


def _lookahead_scores(
    ids: np.ndarray, layer: int, num_experts: int, precision: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """``[D', E]`` router lookahead scores of layers ``layer + 1 ..`` for a step's ``ids [T, L, k]``
    (``D'`` = ``len(precision)`` clipped to the last layer): per token and later layer ``d``, each
    real expert is guessed with probability ``precision[d - 1]``, else a random expert the token did
    not choose; the scores are the guesses' counts (the runtime hands over expected counts)."""
    hi = min(ids.shape[1], layer + 1 + len(precision))
    out = np.zeros((max(0, hi - layer - 1), num_experts), dtype=np.float32)
    for j in range(layer + 1, hi):
        true = ids[:, j, :]
        true = true[(true >= 0).all(axis=1)]  # [T', k] tokens routed there
        guess = true.copy()
        wrong = rng.random(true.shape) >= precision[j - layer - 1]
        idx = wrong.nonzero()
        draw = rng.integers(0, num_experts, size=len(idx[0]))
        clash = (draw[:, None] == true[idx[0]]).any(axis=1)
        while clash.any():  # a wrong guess names an expert the token did not choose
            draw[clash] = rng.integers(0, num_experts, size=int(clash.sum()))
            clash = (draw[:, None] == true[idx[0]]).any(axis=1)
        guess[idx] = draw
        out[j - layer - 1] = np.bincount(guess.ravel(), minlength=num_experts)
    return out


def _layer_counts(ids: np.ndarray, num_experts: int) -> tuple[list[list[int]], np.ndarray]:
    """Per layer: the needed experts (ascending) and every expert's token count ``[L, E]``, for a step's
    ``ids [T, L, k]`` (``-1`` skipped), with one ``bincount`` for all layers."""
    num_layers = ids.shape[1]
    layer = np.arange(num_layers, dtype=np.int64)[None, :, None]
    valid = ids >= 0
    flat = (layer * num_experts + ids)[valid] if not valid.all() else (layer * num_experts + ids).ravel()
    counts = np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)
    rows, cols = np.nonzero(counts)
    bounds = np.searchsorted(rows, np.arange(num_layers + 1)).tolist()
    cols_l = cols.tolist()
    needed = [cols_l[bounds[i] : bounds[i + 1]] for i in range(num_layers)]
    return needed, counts


class RunState:
    """One policy run's live objects: the buffer, the prefetch policy, the recorder (or None)."""

    __slots__ = ("buffer", "prefetcher", "recorder", "by_id", "jitter", "ahead", "tally", "gate")

    def __init__(self, buffer: SimBuffer, prefetcher: Any, recorder: Any | None) -> None:
        self.buffer, self.prefetcher, self.recorder = buffer, prefetcher, recorder
        self.by_id: dict[str, SimRequest] = {}
        self.jitter: np.random.Generator | None = None  # layer-time noise (SimConfig.layer_jitter_s)
        self.ahead: tuple[np.ndarray, np.random.Generator] | None = None  # lookahead precision, rng
        self.tally: StepTally | None = None  # the measured steps' placement counts and bound
        self.gate: Any = None  # the prefetch gate whose b a CPU miss caps (hybrid auto)
