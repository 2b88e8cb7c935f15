"""The engine: add requests, step, stream outputs (vLLM's ``LLMEngine`` shape, MoE-offloading inside).

``step()`` is schedule -> execute -> update. It is not thread-safe: one engine thread owns it (the
server's engine client forwards requests to that thread).

Failure isolation: an exception while scheduling or in the forward pass is a runtime (device)
fault and propagates out of ``step()``: the engine is then unusable. An exception in one request's
post-processing (sampling, detokenising, stop checks, building its output) finishes only that
request, with ``finish_reason="error"`` and ``RequestOutput.error`` saying what failed; every other
request of the step carries on.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine import context as step_context
from moe_runtime.engine.context import StepContext
from moe_runtime.engine.detokenizer import finish_text, take_delta, update_text
from moe_runtime.engine.request import RequestOutput, SamplingParams, Sequence, SequenceStatus
from moe_runtime.engine.sampler import Sampled, sample, token_logprob
from moe_runtime.engine.scheduler import ScheduledSeq, Scheduler
from moe_runtime.engine.structured import GrammarMatcher
from moe_runtime.errors import ConfigError, RequestError
from moe_runtime.hybrid import setup as hybrid_setup
from moe_runtime.layers.kv_cache import KVCache
from moe_runtime.layers.mla_cache import MLACache
from moe_runtime.layers.router_lookahead import RouterLookahead
from moe_runtime.loader import LoadedModel, load_checkpoint
from moe_runtime.memory_plan import buffer_slot_count, engine_devices, human_bytes, kv_cache_len
from moe_runtime.model import MoEModel
from moe_runtime.prefetch import make_prefetch_policy
from moe_runtime.stats import EngineStats

MiB = 1 << 20
log = logging.getLogger("moeserve.engine")


class LLMEngine:
    """Serve one checkpoint with experts offloaded.

    Args:
        loaded: a :class:`LoadedModel` (see :meth:`from_pretrained`).
        runtime: the user's settings.
        recorder: the tracer's ``RequestRecorder`` (or any object with its methods), or None. The
            ``eam`` policies need one; it is created (with an EAMC of ``runtime.eamc_capacity``)
            when they are chosen and none is given.
        eamc: the EAM collection the ``eam`` prefetch policy matches against (default: the
            recorder's).
        policy_context: extra policy inputs, e.g. ``{"oracle": OracleSchedule(...)}``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        runtime: RuntimeConfig,
        recorder: Any | None = None,
        eamc: Any | None = None,
        policy_context: dict[str, Any] | None = None,
    ) -> None:
        cfg = loaded.config
        total = cfg.num_moe_layers * cfg.num_experts
        slots = buffer_slot_count(runtime, total)
        # With every expert resident no policy has anything to decide: skip their per-layer work.
        offloading = slots < total
        prefetch_policy = runtime.prefetch_policy if offloading else "on-demand"
        cache_policy = runtime.cache_policy if offloading else "lru"
        # hybrid expert execution (moe_runtime.hybrid): cpu mode keeps a fixed resident set, so
        # there is nothing to prefetch or evict
        self.expert_compute = runtime.expert_compute_mode
        if self.expert_compute == "cpu":
            prefetch_policy, cache_policy = "on-demand", "lru"
        if (prefetch_policy.startswith("eam") or cache_policy.startswith("eam")) and recorder is None:
            recorder = _default_recorder(cfg, runtime, eamc)
        if eamc is None and recorder is not None:
            eamc = getattr(recorder, "eamc", None)
        self.eamc = eamc
        self.loaded, self.runtime, self.recorder = loaded, runtime, recorder
        if runtime.cpu_threads is not None:
            torch.set_num_threads(runtime.cpu_threads)
        self.config = cfg
        self.tokenizer = loaded.tokenizer
        self.max_model_len = kv_cache_len(cfg, runtime)
        n_dev = runtime.num_devices
        device = runtime.torch_device  # ``cuda`` -> the current CUDA device, indexed
        devices = engine_devices(runtime)
        link = (runtime.link_gbps, runtime.link_latency_us) if runtime.link_gbps else None
        context = {"recorder": recorder, **(policy_context or {})}
        self.buffer = ExpertBuffer(
            loaded.store,
            devices,
            total if not offloading else math.ceil(slots / n_dev),
            cache_policy,
            link,
            context,
        )
        if cfg.mla is not None:  # the latent, not expanded K/V
            width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
            self.kv = MLACache(
                cfg.num_layers, runtime.max_batch_size, self.max_model_len, width, runtime.torch_dtype, device
            )
        else:
            self.kv = KVCache(
                cfg.num_layers,
                runtime.max_batch_size,
                cfg.num_kv_heads,
                self.max_model_len,
                cfg.head_dim,
                runtime.torch_dtype,
                device,
                cfg.layer_windows,
            )
        self.model = MoEModel(cfg, loaded.dense, self.buffer, self.kv, self.max_model_len)
        self.hybrid = hybrid_setup.attach(self.buffer, runtime, self.expert_compute)  # None: device mode
        step_context.warm()  # the step's expert attribution is compiled: not on the first step's clock
        self.prefetcher = make_prefetch_policy(
            prefetch_policy,
            buffer=self.buffer,
            num_layers=cfg.num_moe_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            recorder=recorder,
            depth=runtime.prefetch_depth,
            eamc=eamc,
            lookahead=runtime.router_lookahead,
            **(policy_context or {}),
        )
        self.model.recorder = recorder
        self.model.prefetcher = self.prefetcher
        if getattr(self.prefetcher, "lookahead_depth", 0) > 0:
            self.model.lookahead = RouterLookahead(
                cfg, loaded.dense, self.prefetcher.lookahead_depth, policy=self.prefetcher
            )
        self.scheduler = Scheduler(runtime.max_batch_size, runtime.max_num_batched_tokens)
        self.eos_token_ids = loaded.eos_token_ids
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, GrammarMatcher] = {}  # sequences with a grammar (structured output)
        self.device = device
        self.last_logits: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return self.stats.steps

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        runtime: RuntimeConfig | None = None,
        recorder: Any | None = None,
        **kwargs: Any,
    ) -> LLMEngine:
        """Load ``model_dir`` and build the engine; ``kwargs`` go to the constructor (``eamc``, ...)."""
        runtime = runtime or RuntimeConfig()
        return cls(load_checkpoint(model_dir, runtime), runtime, recorder, **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, task: str | None = None
    ) -> None:
        """Queue a request (FCFS).

        Raises:
            RequestError: empty prompt, token id out of range (prompt or ``logit_bias``),
                duplicate id, a prompt that leaves no room to generate within ``max_model_len``,
                or a grammar that does not compile.
        """
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is out of range [0, {vocab})", "prompt")
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias token id {bad} is out of range [0, {vocab})", "logit_bias")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                f"{self.max_model_len} tokens including at least one generated token",
                "prompt",
            )
        if params.grammar is not None:
            self._matchers[request_id] = GrammarMatcher(
                params.grammar, self.tokenizer, vocab, list(self.eos_token_ids)
            )
        seq = Sequence(request_id, list(prompt_token_ids), params, task)
        self._seqs[request_id] = seq
        if not params.greedy:
            gen = torch.Generator(device=self.device)  # where the logits are: multinomial needs it
            seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy)
            gen.manual_seed(seed % 2**64)  # torch's range; -1 and 2**64 - 1 seed alike, as before
            self._generators[request_id] = gen
        if self.recorder is not None:
            self.recorder.begin_request(request_id, len(prompt_token_ids), task)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drop a waiting or running request, freeing its KV row. Returns False if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort", commit=False)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled batch; return one output per request that
        produced a token or finished."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        t0 = time.perf_counter()
        ids, past = [], []
        for s in scheduled:
            past.append(s.seq.num_computed)
            ids.extend(s.seq.all_token_ids()[s.seq.num_computed : s.seq.num_computed + s.num_new])
        step = StepContext.build(
            [s.seq.request_id for s in scheduled],
            [s.seq.kv_row for s in scheduled],
            past,
            [s.num_new for s in scheduled],
            [s.sample for s in scheduled],
            self.device,
        )
        scored = self._score_prompts(scheduled, step)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=self.device), step)
        if scored:
            logits = self._take_prompt_logprobs(scheduled, logits, scored)
        self.last_logits = logits  # [N, V] fp32, rows in scheduled order of sampling sequences
        if self.recorder is not None:
            self.recorder.end_step()
        self.prefetcher.end_step()
        sampling = [s.seq for s in scheduled if s.sample]
        picks = sample(
            logits,
            [q.params for q in sampling],
            [self._generators.get(q.request_id) for q in sampling],
            history=[(q.prompt_token_ids, q.output_token_ids) for q in sampling]
            if any(q.params.penalized for q in sampling)
            else None,
            allowed=self._allowed(sampling),
        )
        outputs = self._update(scheduled, step, dict(zip((q.request_id for q in sampling), picks)))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        return outputs

    def _score_prompts(self, scheduled: list[ScheduledSeq], step: StepContext) -> list[int]:
        """Add the logits rows prompt logprobs need to ``step.logits_index`` (after the sampling
        rows); returns, per scheduled sequence, how many it added (empty when none did)."""
        if not any(s.seq.params.prompt_logprobs is not None and s.seq.is_prefill for s in scheduled):
            return []
        extra, counts = [], []
        for i, s in enumerate(scheduled):
            seq, n = s.seq, 0
            if seq.params.prompt_logprobs is not None and seq.is_prefill:
                # position j's logits score prompt token j + 1; the prompt's last position samples
                first = seq.num_computed
                last = min(first + s.num_new, len(seq.prompt_token_ids) - 1)
                extra.extend(step.starts[i] + j - seq.num_computed for j in range(first, last))
                n = max(0, last - first)
            counts.append(n)
        index = torch.tensor(extra, dtype=torch.int64, device=self.device)
        step.logits_index = torch.cat([step.logits_index, index])
        return counts

    def _take_prompt_logprobs(
        self, scheduled: list[ScheduledSeq], logits: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """Record the prompt logprobs of the extra rows; return the sampling rows ``[N, V]``."""
        n = sum(1 for s in scheduled if s.sample)
        logp = logits[n:].log_softmax(-1)
        row = 0
        for s, k in zip(scheduled, counts):
            seq = s.seq
            if seq.params.prompt_logprobs is not None and seq.is_prefill and seq.num_computed == 0:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context
            for j in range(seq.num_computed, seq.num_computed + k):
                target = seq.prompt_token_ids[j + 1]
                seq.prompt_logprobs.append(token_logprob(logp[row], target, seq.params.prompt_logprobs or 0))
                row += 1
        return logits[:n]

    def _allowed(self, sampling: list[Sequence]) -> dict[int, torch.Tensor] | None:
        """Row -> grammar mask ``[V]`` of the sampling rows that have a grammar."""
        if not self._matchers:
            return None
        return {
            i: self._matchers[q.request_id].allowed().to(self.device)
            for i, q in enumerate(sampling)
            if q.request_id in self._matchers
        }

    def _update(
        self, scheduled: list[ScheduledSeq], step: StepContext, picks: dict[str, Sampled | Exception]
    ) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        lookups, hits, blocking = step.expert_attribution(self.config.num_experts)
        on_cpu = step.cpu_attribution(self.config.num_experts) if self.hybrid is not None else None
        for i, s in enumerate(scheduled):
            seq = s.seq
            if seq.status == SequenceStatus.FINISHED:  # aborted by a hook during the step
                continue
            if seq.is_prefill:
                self.stats.prompt_tokens += s.num_new
            seq.num_computed += s.num_new
            es = seq.expert_stats
            es.lookups += int(lookups[i])
            es.hits += int(hits[i])
            es.blocking_s += float(blocking[i])
            if on_cpu is not None:
                es.cpu_experts += int(on_cpu[0][i])
                es.cpu_s += float(on_cpu[1][i])
                es.bytes_not_moved += int(on_cpu[0][i]) * self.loaded.store.expert_nbytes
            if not s.sample:
                continue
            try:
                outputs.append(self._advance(seq, picks[seq.request_id], now))
            except Exception as exc:  # this request's fault only: finish it, keep the batch
                outputs.append(self._fail(seq, exc))
        return outputs

    def _advance(self, seq: Sequence, pick: Sampled | Exception, now: float) -> RequestOutput:
        """Append one sampled token, check the stops, build the output; raises for this request."""
        if isinstance(pick, Exception):
            raise pick
        seq.output_token_ids.append(pick.token)
        if (matcher := self._matchers.get(seq.request_id)) is not None:
            matcher.consume(pick.token)
        if pick.logprob is not None:
            seq.output_logprobs.append(pick.logprob)
        self.stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = self._stop_reason(seq, pick.token)
        if reason is not None:
            self._finish(seq, reason, commit=True)
        return self._output(seq, new_tokens=1)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Finish ``seq`` with ``finish_reason="error"``; its output carries one line on why."""
        log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)
        if seq.status != SequenceStatus.FINISHED:
            self._finish(seq, "error", commit=False)
        else:  # it failed after finishing (building its output): count it as an error
            self.stats.requests_finished[seq.finish_reason] -= 1
            self.stats.requests_finished["error"] = self.stats.requests_finished.get("error", 0) + 1
            seq.finish_reason = "error"
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            new_text="",
            text=seq.output_text[: seq.sent_text_len],
            finished=True,
            finish_reason="error",
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            output_token_ids=list(seq.output_token_ids),
            logprobs=None,
            expert_stats=seq.expert_stats,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            error=f"generation failed for this request ({type(exc).__name__})",
        )

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if update_text(seq, self.tokenizer):
            return "stop"
        reason = None
        matcher = self._matchers.get(seq.request_id)
        eos = not p.ignore_eos and token in self.eos_token_ids
        if token in p.stop_token_ids or eos or (matcher is not None and matcher.finished):
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            finish_text(seq, self.tokenizer)
        return reason

    def _finish(self, seq: Sequence, reason: str, commit: bool) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.finish(seq)
        self._seqs.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)
        self._matchers.pop(seq.request_id, None)
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1
        if self.recorder is not None:
            (self.recorder.finish if commit else self.recorder.abort)(seq.request_id)

    def _output(self, seq: Sequence, new_tokens: int) -> RequestOutput:
        finished = seq.status == SequenceStatus.FINISHED
        with_prompt = seq.params.prompt_logprobs is not None and (seq.sent_tokens == 0 or finished)
        new_ids = seq.output_token_ids[seq.sent_tokens :]
        seq.sent_tokens = len(seq.output_token_ids)
        delta = take_delta(seq, finished)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=delta,
            text=seq.output_text[: seq.sent_text_len],
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            output_token_ids=list(seq.output_token_ids),
            logprobs=seq.output_logprobs[-len(new_ids) :]
            if seq.params.logprobs is not None and new_ids
            else None,
            expert_stats=seq.expert_stats,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            prompt_logprobs=list(seq.prompt_logprobs) if with_prompt else None,
        )

    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits ``[T, V]`` (fp32) at every position of ``token_ids``.

        Runs one prefill in a borrowed KV row, with tracing and prefetching off; engine thread only.

        Raises:
            RequestError: no free KV row, or the sequence does not fit ``max_model_len``.
        """
        if not token_ids or len(token_ids) > self.max_model_len:
            raise RequestError(f"cannot score {len(token_ids)} tokens (context {self.max_model_len})")
        row = self.scheduler.take_row()
        if row is None:
            raise RequestError("no free KV-cache row to score with")
        recorder, prefetcher = self.model.recorder, self.model.prefetcher
        self.model.recorder = self.model.prefetcher = None
        try:
            step = StepContext.build(
                ["score"], [row], [0], [len(token_ids)], [True], self.device, all_logits=True
            )
            step.observe = False
            return self.model.forward(torch.tensor(token_ids, dtype=torch.int64, device=self.device), step)
        finally:
            self.model.recorder, self.model.prefetcher = recorder, prefetcher
            self.scheduler.return_row(row)

    # ------------------------------------------------------------------ conveniences
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion together; returns each request's final output, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def summary(self) -> str:
        """One line: dense bytes on device, expert bytes in host memory, slots and their bytes, the
        KV cache (and the sliding layers' ring length), the expert path (``grouped`` GEMMs or a
        per-expert ``loop``)."""
        st, buf = self.loaded.store, self.buffer
        total = st.num_layers * st.num_experts
        return (
            f"{self.config.architecture}: dense {self.loaded.dense_nbytes / MiB:.1f} MiB on {self.device}, "
            f"experts {st.nbytes / MiB:.1f} MiB in host memory ({total} experts x "
            f"{st.expert_nbytes / MiB:.2f} MiB{', pinned' if st.data.is_pinned() else ''}), "
            f"buffer {buf.num_slots} slots x {st.expert_nbytes / MiB:.2f} MiB = "
            f"{buf.num_slots * st.expert_nbytes / MiB:.1f} MiB "
            f"({100 * min(buf.num_slots, total) / total:.0f}% "
            f"of experts) on {len(buf.parts)} device(s), "
            f"KV cache {self.kv.nbytes / MiB:.1f} MiB{self._ring_note()}, "
            f"{self._expert_format()}, "
            f"{hybrid_setup.describe(self.hybrid, self.runtime, self.expert_compute)}, "
            f"experts run {self.model.expert_path}"
        )

    def _expert_format(self) -> str:
        """``experts fp8 e4m3 block [64, 64], 24.0 KiB per expert (96.0 KiB unquantized)``: the
        bytes each copy moves, before and after quantizing (the same without quantization)."""
        st = self.loaded.store
        plain = str(st.compute_dtype).removeprefix("torch.")
        name = st.layout.describe() if st.layout else plain
        return (
            f"experts {name}, {human_bytes(st.expert_nbytes)} per expert "
            f"({human_bytes(st.plain_nbytes)} in {plain})"
        )

    def _ring_note(self) -> str:
        """`` (N sliding layers hold W positions)`` where sliding-window layers keep KV rings."""
        ring = self.kv.ring
        if not ring:
            return ""
        windows = "/".join(str(w) for w in sorted(set(ring.values())))
        return f" ({len(ring)} sliding layers hold {windows} positions)"

    def close(self) -> None:
        if self.hybrid is not None:
            self.hybrid.close()
        self.buffer.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_recorder(cfg, runtime: RuntimeConfig, eamc: Any | None) -> Any:
    """A tracer recorder with an EAMC, for the ``eam`` policies."""
    try:
        from tracer.eamc import EAMC
        from tracer.recorder import RequestRecorder
    except ImportError as exc:  # pragma: no cover - the tracer ships with the package
        raise ConfigError(f"the eam policies need the tracer package ({exc})") from None
    if eamc is None:
        eamc = EAMC(cfg.num_moe_layers, cfg.num_experts, capacity=runtime.eamc_capacity)
    return RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, eamc=eamc)
