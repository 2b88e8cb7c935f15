"""``POST /v1/chat/completions``: chat over the checkpoint's chat template, streamed or whole.

Messages are rendered with the tokenizer's jinja chat template (``tokenizer_config.json``
``chat_template``), or, when the checkpoint has none, the fallback documented in
``moe_runtime/tokenizer.py`` (``<role>: content`` lines, then ``assistant:``). Content may be a
string or a list of ``{"type": "text", "text": ...}`` parts; other part types are refused (400).
Without ``max_tokens``/``max_completion_tokens`` the reply may use the rest of the context.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import jinja2
from fastapi import APIRouter, Request, Response

from moe_runtime.engine.request import RequestOutput, TokenLogprob
from server.engine_client import RequestStream
from server.errors import APIError, invalid
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from server.routes.common import (
    check_model,
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
from server.routes.limits import check_logprobs, check_sampling, check_text
from server.sse import DONE, EventStreamResponse, sse_event, unless_disconnected
from server.state import ServerState


def make_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(
        body: ChatCompletionRequest, request: Request
    ) -> Response | ChatCompletionResponse:
        return await _chat(get_state(request), body, request)

    return router


def _message(m: ChatMessage, i: int) -> dict[str, str]:
    check_text(m.role, f"messages.{i}.role")
    if m.content is None or isinstance(m.content, str):
        content = m.content or ""
    else:
        parts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                msg = f"content part type {part.type!r} is not supported (text only)"
                raise invalid(msg, f"messages.{i}")
            parts.append(part.text)
        content = "".join(parts)
    check_text(content, f"messages.{i}.content")
    return {"role": m.role, "content": content}


def _prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if not body.messages:
        raise invalid("messages is empty", "messages")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    if state.tokenizer is None:
        raise invalid("this model has no tokenizer.json, so chat is unavailable", "messages")
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise invalid(f"the chat template failed on these messages: {exc}", "messages") from None
    return tokenize(state, text, "messages", add_special_tokens=False)


def _logprobs(state: ServerState, lps: list[TokenLogprob]) -> ChatChoiceLogprobs:
    content = []
    for lp in lps:
        text = token_text(state, lp.token_id)
        top = [
            TopLogprob(token=token_text(state, t), logprob=v, bytes=list(token_text(state, t).encode()))
            for t, v in lp.top.items()
        ]
        content.append(
            ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top)
        )
    return ChatChoiceLogprobs(content=content)


async def _chat(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response | ChatCompletionResponse:
    model = check_model(state, body.model)
    check_unsupported(body)
    check_sampling(state, body, 1)
    check_logprobs(body.top_logprobs, "top_logprobs")
    if body.tools:
        raise invalid("tools are not supported", "tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
    ids = _prompt_ids(state, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = max_tokens_for(requested, len(ids), state.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    response_id, created = new_id("chatcmpl"), now()
    stream = await state.client.submit(engine_requests(response_id, body, [ids], [max_tokens], logprobs))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(state, stream, response_id, created, model, body.n, len(ids), include_usage)
        return EventStreamResponse(events, on_close=stream.abort)
    finals = await unless_disconnected(request, lambda: collect(stream), stream.abort)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=out.text),
            logprobs=_logprobs(state, lps) if body.logprobs else None,
            finish_reason=out.finish_reason,
        )
        for index, (out, lps) in sorted(finals.items())
    ]
    return ChatCompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage([len(ids)], (o for o, _ in finals.values())),
    )


async def _events(
    state: ServerState,
    stream: RequestStream,
    response_id: str,
    created: int,
    model: str,
    n: int,
    prompt_len: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE chunks: a role chunk per choice, content deltas, a finish chunk, usage, ``[DONE]``."""

    def chunk(choices: list[ChatStreamChoice], **extra: object) -> str:
        resp = ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices)
        payload = resp.model_dump(exclude=None if include_usage else {"usage"})
        for c in payload["choices"]:
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        payload.update(extra)
        return sse_event(payload)

    finals: list[RequestOutput] = []
    try:
        for index in range(n):
            yield chunk([ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
        async for out in stream:
            index = choice_index(out.request_id)
            lps = _logprobs(state, out.logprobs) if out.logprobs else None
            if out.new_text or lps is not None:
                yield chunk(
                    [ChatStreamChoice(index=index, delta=ChatDelta(content=out.new_text), logprobs=lps)]
                )
            if out.finished:
                finals.append(out)
                yield chunk(
                    [ChatStreamChoice(index=index, delta=ChatDelta(), finish_reason=out.finish_reason)]
                )
        if include_usage:
            yield chunk([], usage=usage([prompt_len], finals).model_dump())
    except APIError as exc:
        yield sse_event(exc.body())
    yield DONE
