"""Step outputs: each sampled token appended, stop checks, finishing, the ``RequestOutput``.

A mixin of :class:`~moe_runtime.engine.engine.LLMEngine`. Failure isolation: an exception in one
request's post-processing (sampling, detokenising, stop checks, building its output) finishes only
that request, with ``finish_reason="error"`` and ``RequestOutput.error`` saying what failed; every
other request of the step carries on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from moe_runtime.engine.context import StepContext
from moe_runtime.engine.detokenizer import finish_text, take_delta, update_text
from moe_runtime.engine.request import RequestOutput, Sequence, SequenceStatus
from moe_runtime.engine.sampler import Sampled
from moe_runtime.engine.scheduler import ScheduledSeq

log = logging.getLogger("moeserve.engine")


class StepOutputs:
    """What a step's sampled tokens do to their sequences."""

    config: Any
    loaded: Any
    hybrid: Any
    tokenizer: Any
    max_model_len: int
    scheduler: Any
    recorder: Any
    stats: Any
    eos_token_ids: Any
    _seqs: dict
    _generators: dict
    _matchers: dict

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
            seq.num_computed += s.num_new
            self._mark_recorded(seq, seq.num_computed)
            self.scheduler.computed(seq)  # its full blocks join the prefix cache
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

    def _mark_recorded(self, seq: Sequence, upto: int) -> None:
        """Positions below ``upto`` are computed or served from the prefix cache: the tracer counted
        them (``num_recorded``), and prompt positions among them count once as prompt tokens
        (not again when a preempted sequence recomputes them)."""
        prompt = len(seq.prompt_token_ids)
        before = min(seq.num_recorded, prompt)
        seq.num_recorded = max(seq.num_recorded, upto)
        self.stats.prompt_tokens += min(seq.num_recorded, prompt) - before

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
            num_cached_tokens=seq.num_cached_tokens or 0,
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
            num_cached_tokens=seq.num_cached_tokens or 0,
        )
