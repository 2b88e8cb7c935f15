"""Request admission: validation, per-request state (generator, grammar, tracer) and abort.

A mixin of :class:`~moe_runtime.engine.engine.LLMEngine`; it uses the engine's ``config``,
``tokenizer``, ``max_model_len``, ``scheduler``, ``recorder``, ``device`` and the per-request maps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moe_runtime.engine.request import SamplingParams, Sequence
from moe_runtime.engine.structured import GrammarMatcher
from moe_runtime.errors import RequestError


class RequestAdmission:
    """``add_request`` / ``abort_request`` and the queue's figures."""

    config: Any
    tokenizer: Any
    max_model_len: int
    scheduler: Any
    recorder: Any
    device: torch.device
    eos_token_ids: Any
    _seqs: dict[str, Sequence]
    _generators: dict[str, torch.Generator]
    _matchers: dict[str, GrammarMatcher]

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
        """Drop a waiting or running request, freeing its KV blocks. Returns False if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort", commit=False)  # type: ignore[attr-defined]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
