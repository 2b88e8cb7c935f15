"""Scoring prompts: prompt logprobs during prefill, and teacher-forced logits of a token sequence.

A mixin of :class:`~moe_runtime.engine.engine.LLMEngine`. Prompt logprobs come from extra logits
rows of the prefill steps (after the sampling rows); a request that asks for them skips the prefix
cache (every prompt position must be computed) and, if preempted and recomputed, is not scored
twice (positions already scored are skipped).
"""

from __future__ import annotations

from typing import Any

import torch

from moe_runtime.engine.context import StepContext
from moe_runtime.engine.sampler import token_logprob
from moe_runtime.engine.scheduler import ScheduledSeq
from moe_runtime.errors import RequestError


def _scored(seq) -> int:
    """Prompt positions whose logits already scored the next prompt token."""
    return max(0, len(seq.prompt_logprobs) - 1)


class PromptScoring:
    """Prompt logprobs and :meth:`prefill_logits`."""

    model: Any
    kv_manager: Any
    device: torch.device
    max_model_len: int

    def _score_prompts(self, scheduled: list[ScheduledSeq], step: StepContext) -> list[tuple[int, int]]:
        """Add the logits rows prompt logprobs need to ``step.logits_index`` (after the sampling
        rows); returns, per scheduled sequence, the first prompt position scored and how many
        (empty when none is)."""
        wanted = [s.seq.params.prompt_logprobs is not None and s.seq.is_prefill for s in scheduled]
        if not any(wanted):
            return []
        extra, spans = [], []
        for i, (s, want) in enumerate(zip(scheduled, wanted)):
            seq, first, n = s.seq, 0, 0
            if want:
                # position j's logits score prompt token j + 1; the prompt's last position samples
                first = max(seq.num_computed, _scored(seq))
                last = min(seq.num_computed + s.num_new, len(seq.prompt_token_ids) - 1)
                extra.extend(step.starts[i] + j - seq.num_computed for j in range(first, last))
                n = max(0, last - first)
            spans.append((first, n))
        index = torch.tensor(extra, dtype=torch.int64, device=self.device)
        step.logits_index = torch.cat([step.logits_index, index])
        return spans

    def _take_prompt_logprobs(
        self, scheduled: list[ScheduledSeq], logits: torch.Tensor, spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Record the prompt logprobs of the extra rows; return the sampling rows ``[N, V]``."""
        n = sum(1 for s in scheduled if s.sample)
        logp = logits[n:].log_softmax(-1)
        row = 0
        for s, (first, k) in zip(scheduled, spans):
            seq = s.seq
            if seq.params.prompt_logprobs is not None and seq.is_prefill and not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context
            for j in range(first, first + k):
                target = seq.prompt_token_ids[j + 1]
                seq.prompt_logprobs.append(token_logprob(logp[row], target, seq.params.prompt_logprobs or 0))
                row += 1
        return logits[:n]

    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits ``[T, V]`` (fp32) at every position of ``token_ids``.

        Runs one prefill in KV blocks borrowed from the pool (not cached), with tracing and
        prefetching off; engine thread only.

        Raises:
            RequestError: the sequence does not fit ``max_model_len``, or too few KV blocks are free.
        """
        if not token_ids or len(token_ids) > self.max_model_len:
            raise RequestError(f"cannot score {len(token_ids)} tokens (context {self.max_model_len})")
        tables = self.kv_manager.allocate_scratch(len(token_ids))
        if tables is None:
            raise RequestError("not enough free KV-cache blocks to score with")
        recorder, prefetcher = self.model.recorder, self.model.prefetcher
        self.model.recorder = self.model.prefetcher = None
        try:
            step = StepContext.build(
                ["score"],
                [tables],
                [0],
                [len(token_ids)],
                [True],
                self.device,
                self.kv_manager.block_size,
                all_logits=True,
            )
            step.observe = False
            return self.model.forward(torch.tensor(token_ids, dtype=torch.int64, device=self.device), step)
        finally:
            self.model.recorder, self.model.prefetcher = recorder, prefetcher
            self.kv_manager.free_scratch(tables)
