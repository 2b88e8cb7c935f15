"""Requests as the engine sees them: sampling parameters, sequences and per-step outputs."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from moe_runtime.errors import RequestError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by a smaller one
overflows float32 or leaves one token with all the mass anyway."""


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most new tokens to generate (>= 1).
        temperature: finite, >= 0. Below :data:`GREEDY_TEMPERATURE` (1e-5, vLLM's rule) the
            request is greedy (argmax); above it logits are divided by it before sampling.
        top_p: nucleus sampling mass in (0, 1], finite; 1 disables it. The most likely token is
            always kept, however small ``top_p`` is.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: seeds this request's own generator, so its samples do not depend on batching
            (taken modulo 2**64, so any int works).
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: extra token ids that end generation (EOS ids are always included unless
            ``ignore_eos``).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: when set, return the chosen token's log-probability and this many top
            alternatives per generated token (0..20).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in
            the output (OpenAI's definition; 0 = off).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it is in
            the output (0 = off).
        repetition_penalty: in (0, 2]; tokens of the prompt or the output have positive logits
            divided by it and negative ones multiplied by it (transformers' and vLLM's rule; 1 = off).
        min_p: in [0, 1]; after temperature, tokens whose probability is below ``min_p`` times
            the top token's are dropped (0 = off).
        logit_bias: token id -> value added to its logit before sampling (greedy included).
        prompt_logprobs: when set, also return each prompt token's log-probability given the
            tokens before it, with this many top alternatives (0..20; the first token has none).
        grammar: an llguidance grammar (``moe_runtime.engine.structured``) the output must match;
            tokens it does not allow are masked before sampling.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", "temperature"
            )
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise RequestError(
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", "prompt_logprobs"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise RequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise RequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty"
            )
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not math.isfinite(v) for v in self.logit_bias.values()):
            raise RequestError("logit_bias values must be finite", "logit_bias")

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax: ``temperature < GREEDY_TEMPERATURE`` (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives (natural log)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(slots=True)
class ExpertRequestStats:
    """Expert-buffer figures attributed to one request (the ``usage.expert_stats`` extension).

    A lookup is one (MoE layer, expert) that at least one of the request's tokens was routed to
    in a step; it is a hit when the expert was resident or fully prefetched at that moment.
    Blocking seconds are those the compute thread waited for experts this request used.
    With hybrid execution (``moe_runtime.hybrid``): ``cpu_experts`` of those lookups were misses
    computed on the CPU (not copied), taking ``cpu_s`` seconds of the CPU threads' time, and
    ``bytes_not_moved`` the copies they avoided.
    """

    lookups: int = 0
    hits: int = 0
    blocking_s: float = 0.0
    cpu_experts: int = 0
    cpu_s: float = 0.0
    bytes_not_moved: int = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


@dataclass(slots=True)
class Sequence:
    """One generation stream: prompt + output tokens and progress.

    Attributes (KV cache, ``moe_runtime.engine.kv_manager``):
        num_computed: positions whose K/V are in the cache (0 again after a preemption).
        num_cached_tokens: prompt positions a prefix-cache hit supplied at the first admission
            (``usage.prompt_tokens_details.cached_tokens``); None until admitted.
        num_recorded: positions whose expert routing the tracer counted (or was credited from
            cached blocks); a recompute after preemption does not count them again.
        num_preemptions: times the scheduler preempted it (recompute: its KV blocks were freed).
        kv_hashes: hashes of its full blocks, computed once (prefix caching).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    task: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # filled during prefill
    num_computed: int = 0
    num_cached_tokens: int | None = None
    num_recorded: int = 0
    num_preemptions: int = 0
    kv_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    output_text: str = ""  # settled text: never ends inside a multi-byte character
    prefix_offset: int = 0  # detokenizer window: output tokens [prefix_offset, read_offset) are
    read_offset: int = 0  # already in output_text; decoding starts at prefix_offset for context
    sent_text_len: int = 0  # characters already handed out as deltas
    sent_tokens: int = 0
    expert_stats: ExpertRequestStats = field(default_factory=ExpertRequestStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens ``start .. start + n - 1`` (prompt then output), without joining the two lists."""
        prompt = self.prompt_token_ids
        if start + n <= len(prompt):
            return prompt[start : start + n]
        if start >= len(prompt):
            out = self.output_token_ids
            return out[start - len(prompt) : start - len(prompt) + n]
        return prompt[start:] + self.output_token_ids[: start + n - len(prompt)]


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request.

    Attributes:
        request_id: the id given to ``add_request``.
        new_token_ids: tokens generated in this step (usually one; none on abort).
        new_text: text delta for those tokens; text that may still turn out to be the start of
            a stop string is held back until it is decided.
        text: all text handed out so far (the concatenation of every ``new_text``).
        logprobs: one entry per new token when the request asked for logprobs.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, on the first and the final
            output: one entry per prompt token (``None`` for the first), else None.
        finished: whether the request is done; then ``finish_reason`` is ``"stop"``,
            ``"length"``, ``"abort"`` or ``"error"``.
        error: on ``finish_reason="error"``, one line saying what failed for this request (its
            sampling, detokenising or stop check raised); the other requests keep running.
        num_prompt_tokens / num_output_tokens: running totals for ``usage``.
        num_cached_tokens: prompt tokens served from the prefix cache (OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``).
        expert_stats: the request's accumulated expert-buffer figures.
        arrival_time / first_token_time / finish_time: ``time.monotonic()`` seconds.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    expert_stats: ExpertRequestStats
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
