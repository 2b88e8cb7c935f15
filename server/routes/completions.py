"""``POST /v1/completions``: text completion, streamed (SSE) or whole, in the OpenAI schema.

``prompt`` may be a string, a list of strings, a list of token ids or a list of token-id lists;
each prompt gets ``n`` choices, numbered ``prompt_index * n + choice``. Every (prompt, choice)
is one engine request, so they batch with everything else in flight. ``echo`` with ``logprobs``
returns the prompt tokens' logprobs too (the first is null), computed during the prefill.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from moe_runtime.engine.request import RequestOutput, TokenLogprob
from server.engine_client import RequestStream
from server.errors import APIError, invalid
from server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.routes.common import (
    check_model,
    check_prompt,
    check_unsupported,
    choice_index,
    collect,
    engine_requests,
    get_state,
    max_tokens_for,
    new_id,
    now,
    token_text,
    tokenize,
    usage,
)
from server.routes.limits import check_logprobs, check_sampling, check_token_ids
from server.routes.response_format import response_grammar
from server.sse import DONE, EventStreamResponse, sse_event, unless_disconnected
from server.state import ServerState


def make_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
        return await _complete(get_state(request), body, request)

    return router


def _prompt_list(prompt: str | list) -> list[str] | list[list[int]]:
    """``prompt`` as a list of prompts (each a text or a list of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt is empty", "prompt")
    return [prompt] if isinstance(prompt[0], int) else prompt


def _prompts(state: ServerState, prompts: list[str] | list[list[int]]) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt and its text (for ``echo``).

    Raises:
        APIError: 400 naming ``prompt`` for an empty prompt, one that fills the context, or a
            token id out of range.
    """
    ids: list[list[int]] = []
    texts: list[str] = []
    for p in prompts:
        if isinstance(p, str):
            ids.append(tokenize(state, p, "prompt"))
            texts.append(p)
        else:
            check_token_ids(state, p, "prompt")
            ids.append(list(p))
            texts.append(state.tokenizer.decode(p) if state.tokenizer is not None else "")
        check_prompt(state, ids[-1], "prompt")
    return ids, texts


def _logprobs(
    state: ServerState, lps: list[TokenLogprob | None], offset: int, ids: list[int] | None = None
) -> CompletionLogprobs:
    """OpenAI completion logprobs; ``text_offset`` counts characters from ``offset``.

    ``ids`` (the prompt's, for echo) names the tokens where an entry is ``None`` (the first prompt
    token: null logprob and alternatives, as OpenAI sends them).
    """
    out = CompletionLogprobs()
    for i, lp in enumerate(lps):
        text = token_text(state, ids[i] if ids is not None else lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(None if lp is None else {token_text(state, t): v for t, v in lp.top.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


async def _complete(
    state: ServerState, body: CompletionRequest, request: Request
) -> Response | CompletionResponse:
    model = check_model(state, body.model)
    check_unsupported(body)
    prompt_list = _prompt_list(body.prompt)
    check_sampling(state, body, len(prompt_list))
    check_logprobs(body.logprobs, "logprobs")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of other than n is not supported", "best_of")
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    grammar = response_grammar(state, body)
    prompts, texts = _prompts(state, prompt_list)
    max_tokens = [max_tokens_for(body.max_tokens, len(p), state.max_model_len) for p in prompts]
    response_id, created = new_id("cmpl"), now()
    prompt_lps = body.logprobs if body.echo else None
    requests = engine_requests(response_id, body, prompts, max_tokens, body.logprobs, grammar, prompt_lps)
    stream = await state.client.submit(requests)
    echo = [texts[i // body.n] if body.echo else "" for i in range(len(prompts) * body.n)]
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(state, stream, response_id, created, model, echo, prompts, include_usage, prompt_lps)
        return EventStreamResponse(events, on_close=stream.abort)
    finals = await unless_disconnected(request, lambda: collect(stream), stream.abort)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    choices = []
    for index in sorted(finals):
        out, lps = finals[index]
        logprobs = None
        if body.logprobs is not None:
            logprobs = _logprobs(state, lps, len(echo[index]))
            if prompt_lps is not None:
                echoed = _logprobs(state, out.prompt_logprobs or [], 0, prompts[index // body.n])
                logprobs = _joined(echoed, logprobs)
        choices.append(
            CompletionChoice(
                index=index,
                text=echo[index] + out.text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
            )
        )
    return CompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage((len(p) for p in prompts), (o for o, _ in finals.values()), body.n),
    )


async def _events(
    state: ServerState,
    stream: RequestStream,
    response_id: str,
    created: int,
    model: str,
    echo: list[str],
    prompts: list[list[int]],
    include_usage: bool,
    prompt_lps: int | None,
) -> AsyncIterator[str]:
    """SSE chunks: one per choice and step that produced text (or finished), usage, ``[DONE]``."""

    def chunk(choices: list[CompletionChoice], **extra: object) -> str:
        resp = CompletionResponse(id=response_id, created=created, model=model, choices=choices)
        payload = resp.model_dump(exclude=None if include_usage else {"usage"})
        payload.update(extra)
        return sse_event(payload)

    offsets = [len(e) for e in echo]
    echoed: set[int] = set()
    finals: list[RequestOutput] = []
    try:
        for index, text in enumerate(echo):
            if text and prompt_lps is None:  # with prompt logprobs: sent with the first output
                yield chunk([CompletionChoice(index=index, text=text)])
        n = len(echo) // len(prompts)
        async for out in stream:
            index = choice_index(out.request_id)
            if prompt_lps is not None and out.prompt_logprobs is not None and index not in echoed:
                echoed.add(index)
                lps = _logprobs(state, out.prompt_logprobs or [], 0, prompts[index // n])
                yield chunk([CompletionChoice(index=index, text=echo[index], logprobs=lps)])
            lps = None
            if out.logprobs:
                lps = _logprobs(state, out.logprobs, offsets[index])
                offsets[index] = lps.text_offset[-1] + len(lps.tokens[-1])
            if out.new_text or out.finished or lps is not None:
                reason = out.finish_reason if out.finished else None
                yield chunk(
                    [CompletionChoice(index=index, text=out.new_text, logprobs=lps, finish_reason=reason)]
                )
            if out.finished:
                finals.append(out)
        if include_usage:
            yield chunk([], usage=usage((len(p) for p in prompts), finals, n).model_dump())
    except APIError as exc:
        yield sse_event(exc.body())
    yield DONE
