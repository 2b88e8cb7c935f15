"""Helpers shared by the completion and chat routes: checks, sampling params, usage, ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from fastapi import Request

from moe_runtime.engine.request import RequestOutput, SamplingParams, TokenLogprob
from moe_runtime.errors import RequestError
from server.engine_client import EngineRequest, RequestStream
from server.errors import APIError, invalid
from server.protocol import ExpertUsage, PromptTokensDetails, SamplingFields, Usage
from server.routes.limits import check_text
from server.state import ServerState


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def new_id(prefix: str) -> str:
    """``<prefix>-<32 hex>``: the response id; engine request ids append ``-<choice index>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: Unix epoch seconds."""
    return int(time.time())


def check_model(state: ServerState, model: str | None) -> str:
    """The model name to answer with.

    Raises:
        APIError: 404 when ``model`` is given and is not the served model.
    """
    served = state.settings.served_model_name
    if model is not None and model != served:
        msg = f"the model {model!r} does not exist; this server serves {served!r}"
        raise APIError(404, msg, "model_not_found", "model")
    return served


def check_unsupported(body: SamplingFields) -> None:
    """400 for OpenAI options this server does not implement (rather than silently ignoring)."""
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    grammar: str | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Engine sampling parameters for choice ``choice`` of a request.

    OpenAI defaults: temperature 1, top_p 1, penalties 0, ``repetition_penalty`` 1, ``min_p`` 0.
    With ``seed``, choice ``i`` is seeded ``seed + i`` so the ``n`` choices differ yet the
    response is reproducible. ``logit_bias`` keys (token ids as strings, checked by
    ``check_sampling``) become ints; ``grammar`` comes from ``response_format``.

    Raises:
        APIError: 400 for a value out of range, naming the field.
    """
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=None if body.seed is None else body.seed + choice,
            stop=[s for s in stop if s],
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            grammar=grammar,
            prompt_logprobs=prompt_logprobs,
        )
    except RequestError as exc:  # the limits checks come first, so only a missed case gets here
        field = str(exc).split(" ", 1)[0]  # its message starts with the field's name
        raise invalid(str(exc), field if field in type(body).model_fields else "body") from None


def engine_requests(
    response_id: str,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
    grammar: str | None = None,
    prompt_logprobs: int | None = None,
) -> list[EngineRequest]:
    """One engine request per (prompt, choice); choice index = prompt index * n + choice."""
    out = []
    for p, ids in enumerate(prompts):
        for c in range(body.n):
            index = p * body.n + c
            params = sampling_params(body, max_tokens[p], logprobs, c, grammar, prompt_logprobs)
            out.append(EngineRequest(f"{response_id}-{index}", ids, params))
    return out


def choice_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


def _index(request_id: str, position: int) -> int:
    """The choice index in an engine request id, else ``position`` (ids not made by the routes)."""
    try:
        return choice_index(request_id)
    except (IndexError, ValueError):
        return position


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """``requested``, or (when None) what the context leaves after the prompt (at least 1).

    A request asking for more than the context leaves is not refused: it ends with
    ``finish_reason="length"`` when the context is full.
    """
    if requested is None:
        return max(1, max_model_len - prompt_len)
    if requested < 1:
        raise invalid(f"max_tokens must be >= 1, got {requested}", "max_tokens")
    return requested


def check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    """400 naming ``param`` when a prompt of token ``ids`` is empty or leaves no room to generate
    within the context (``max_model_len`` tokens, prompt and output together)."""
    if not ids:
        raise invalid(f"{param}: the prompt is empty", param)
    if len(ids) >= state.max_model_len:
        msg = (
            f"the prompt has {len(ids)} tokens; the model's context is {state.max_model_len} tokens "
            "including at least one generated token"
        )
        raise invalid(msg, param)


def usage(prompt_lens: Iterable[int], finals: Iterable[RequestOutput], n: int = 1) -> Usage:
    """OpenAI usage plus ``expert_stats``; prompt tokens count once per prompt, not per choice, and
    so do the prompt's ``cached_tokens`` (its first choice's: choices admitted together share no
    blocks yet)."""
    prompt_tokens = sum(prompt_lens)
    completion_tokens = hits = misses = cpu = not_moved = 0
    blocking_s = cpu_s = 0.0
    first: dict[int, tuple[int, int]] = {}  # prompt -> (lowest choice index, its cached tokens)
    for position, out in enumerate(finals):
        es = out.expert_stats
        completion_tokens += out.num_output_tokens
        hits += es.hits
        misses += es.misses
        blocking_s += es.blocking_s
        cpu, cpu_s, not_moved = cpu + es.cpu_experts, cpu_s + es.cpu_s, not_moved + es.bytes_not_moved
        index = _index(out.request_id, position)
        seen = first.get(index // n)
        if seen is None or index < seen[0]:
            first[index // n] = (index, out.num_cached_tokens)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c for _, c in first.values())),
        expert_stats=ExpertUsage(
            buffer_hits=hits,
            buffer_misses=misses,
            blocking_ms=round(blocking_s * 1000.0, 3),
            cpu_experts=cpu,
            cpu_expert_ms=round(cpu_s * 1000.0, 3),
            bytes_not_moved=not_moved,
        ),
    )


def tokenize(state: ServerState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Raises APIError 400 when the checkpoint has no tokenizer or ``text`` is not valid Unicode."""
    if state.tokenizer is None:
        raise invalid("this model has no tokenizer.json: send the prompt as token ids", param)
    check_text(text, param)
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.token_text(token_id) if state.tokenizer is not None else f"<{token_id}>"


async def collect(stream: RequestStream) -> dict[int, tuple[RequestOutput, list[TokenLogprob]]]:
    """Run a stream to the end: choice index -> (final output, every token's logprobs)."""
    logprobs: dict[int, list[TokenLogprob]] = {}
    finals: dict[int, tuple[RequestOutput, list[TokenLogprob]]] = {}
    async for out in stream:
        index = choice_index(out.request_id)
        logprobs.setdefault(index, []).extend(out.logprobs or [])
        if out.finished:
            finals[index] = (out, logprobs[index])
    return finals
