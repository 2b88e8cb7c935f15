"""``POST /v1/chat/completions``: chat over the checkpoint's chat template, streamed or whole.

Messages are rendered with the tokenizer's jinja chat template (``tokenizer_config.json``
``chat_template``), or, when the checkpoint has none, the fallback documented in
``moe_runtime/tokenizer.py`` (``<role>: content`` lines, then ``assistant:``). Content may be a
string or a list of ``{"type": "text", "text": ...}`` parts; other part types are refused (400).
Whole messages reach the template (``name``, ``tool_calls`` with JSON ``arguments`` parsed into
objects as vLLM does, ``tool_call_id``, ``reasoning_content``), and so do ``tools``,
``documents``, ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``),
``continue_final_message`` and a named ``chat_template``.

Tools: ``tool_choice`` ``"auto"`` (the default with tools) renders the tools and parses calls out
of the output (``server/routes/tool_calls.py``; ``finish_reason="tool_calls"``); ``"none"``
renders no tools and parses nothing; ``"required"`` or a named function also constrains the
output with a grammar (Qwen format only) to calls of the tools, and the reply ends after them.
Tools on a template with no known call format are refused with 400. A reply without calls has
no ``tool_calls`` key. A message role OpenAI does not know is refused with 400. Without
``max_tokens``/``max_completion_tokens`` the reply may use the rest of the context.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import APIRouter, Request, Response

from moe_runtime.chat_template import RESERVED_NAMES, ChatTemplateError
from moe_runtime.engine.request import RequestOutput, TokenLogprob
from server.engine_client import RequestStream
from server.errors import APIError, invalid
from server.protocol import (
    MESSAGE_ROLES,
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
    DeltaToolCall,
    TopLogprob,
)
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
from server.routes.limits import check_logprobs, check_sampling, check_text
from server.routes.response_format import checked_grammar, response_grammar
from server.routes.tool_calls import ToolParser, tool_parser
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


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    """Message ``i`` as the template gets it.

    Raises:
        APIError: 400 for a role OpenAI does not know (``param`` ``messages.<i>.role``), a content
            part that is not text, or text that is not valid Unicode.
    """
    if m.role not in MESSAGE_ROLES:
        msg = f"messages.{i}.role {m.role[:32]!r} is not one of {', '.join(map(repr, MESSAGE_ROLES))}"
        raise invalid(msg, f"messages.{i}.role")
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
    message: dict[str, Any] = {"role": m.role, "content": content if m.content is not None else None}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if (value := getattr(m, key)) is not None:
            check_text(value, f"messages.{i}.{key}")
            message[key] = value
    if m.tool_calls is not None:
        message["tool_calls"] = [_history_call(c) for c in m.tool_calls]
    return message


def _history_call(call: dict[str, Any]) -> dict[str, Any]:
    """A past tool call with its JSON ``arguments`` as an object (templates ``tojson`` them)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


_Tools = tuple[list[dict[str, Any]] | None, ToolParser | None, list[dict[str, Any]] | None]


def _tools(state: ServerState, body: ChatCompletionRequest) -> _Tools:
    """The tools to render, the parser for the calls, and the tools a call is forced from
    (``tool_choice`` ``"required"`` or a named function; None for ``"auto"``/``"none"``).

    Raises:
        APIError: 400 for a malformed ``tool_choice`` or one naming no tool, or tools on a
            template whose call format no parser knows.
    """
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            msg = "tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}"
            raise invalid(msg, "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise invalid(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required'", "tool_choice")
    if not body.tools and choice not in ("none", "auto"):
        raise invalid("tool_choice forces a tool call but tools is empty", "tool_choice")
    if not body.tools or choice == "none":
        return None, None, None
    for i, tool in enumerate(body.tools):
        function = tool.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if tool.get("type", "function") != "function" or not named:
            raise invalid("each tool must be {type: function, function: {name, ...}}", f"tools.{i}")
    assert state.tokenizer is not None
    try:
        source = state.tokenizer.template_source(body.chat_template, body.tools)
    except ChatTemplateError as exc:
        raise invalid(str(exc), "chat_template") from None
    parser = tool_parser(state.tokenizer, source)
    if parser is None:
        msg = "this model's chat template has no tool-call format this server can parse, so tools are refused"
        raise invalid(msg, "tools")
    forced = None
    if choice == "required":
        forced = body.tools
    elif name is not None:
        forced = [t for t in body.tools if t["function"]["name"] == name]
        if not forced:
            raise invalid(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return body.tools, parser, forced


def _forced_grammar(
    state: ServerState, parser: ToolParser, tools: list[dict[str, Any]], parallel: bool
) -> str:
    """The grammar that makes the output calls of ``tools`` (``tool_choice`` required/named).

    Raises:
        APIError: 400 when the call format has no grammar or a tool's parameters do not compile.
    """
    grammar = parser.forced_grammar(tools, parallel)
    if grammar is None:
        msg = f"a forced tool_choice is not supported for the {parser.name} call format (use 'auto')"
        raise invalid(msg, "tool_choice")
    return checked_grammar(state, grammar, "tools")


def chat_prompt(state: ServerState, body: Any, messages: list[ChatMessage], tools: list | None) -> str:
    """The prompt text of a chat request (``body``: a chat or a chat ``/tokenize`` request).

    Raises:
        APIError: 400 for empty messages, bad message text or contradicting options.
        jinja2.TemplateError: the template refused the messages (the caller answers 400).
    """
    if not messages:
        raise invalid("messages is empty", "messages")
    dicts = [_message(m, i) for i, m in enumerate(messages)]
    if state.tokenizer is None:
        raise invalid("this model has no tokenizer.json, so chat is unavailable", "messages")
    if body.continue_final_message and body.add_generation_prompt:
        msg = "continue_final_message needs add_generation_prompt=false"
        raise invalid(msg, "continue_final_message")
    reserved = sorted(RESERVED_NAMES & set(body.chat_template_kwargs or {}))
    if reserved:
        raise invalid(
            f"chat_template_kwargs may not set {reserved} (the request sets them)", "chat_template_kwargs"
        )
    if body.chat_template is not None:
        try:
            state.tokenizer.template_source(body.chat_template, tools)
        except ChatTemplateError as exc:
            raise invalid(str(exc), "chat_template") from None
    return state.tokenizer.apply_chat_template(
        dicts,
        add_generation_prompt=body.add_generation_prompt,
        tools=tools,
        documents=getattr(body, "documents", None),
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
    )


def _prompt_ids(state: ServerState, body: ChatCompletionRequest) -> tuple[list[int], _Tools]:
    if state.tokenizer is None:
        raise invalid("this model has no tokenizer.json, so chat is unavailable", "messages")
    tools = _tools(state, body)
    try:
        text = chat_prompt(state, body, body.messages, tools[0])
    except jinja2.TemplateError as exc:
        raise invalid(f"the chat template failed on these messages: {exc}", "messages") from None
    ids = tokenize(state, text, "messages", add_special_tokens=False)
    check_prompt(state, ids, "messages")
    return ids, tools


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
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
    ids, (_, parser, forced) = _prompt_ids(state, body)
    grammar = response_grammar(state, body)
    if forced is not None and parser is not None:
        if grammar is not None:
            raise invalid("response_format cannot be combined with a forced tool_choice", "response_format")
        grammar = _forced_grammar(state, parser, forced, body.parallel_tool_calls)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = max_tokens_for(requested, len(ids), state.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    response_id, created = new_id("chatcmpl"), now()
    requests = engine_requests(response_id, body, [ids], [max_tokens], logprobs, grammar)
    stream = await state.client.submit(requests)
    calls = _CallSplitter(state, parser, body.parallel_tool_calls)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(state, stream, response_id, created, model, body.n, len(ids), include_usage, calls)
        return EventStreamResponse(events, on_close=stream.abort)
    finals = await unless_disconnected(request, lambda: collect(stream), stream.abort)
    if finals is None:  # the client left; nobody reads this
        return Response(status_code=499)
    choices = []
    for index, (out, lps) in sorted(finals.items()):
        content, tool_calls, reason = calls.split(out)
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=content, tool_calls=tool_calls or None),
                logprobs=_logprobs(state, lps) if body.logprobs else None,
                finish_reason=reason,
            )
        )
    return ChatCompletionResponse(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage([len(ids)], (o for o, _ in finals.values()), body.n),
    )


class _CallSplitter:
    """Content and tool calls of each choice's output; a no-op without a tool parser."""

    def __init__(self, state: ServerState, parser: ToolParser | None, parallel: bool) -> None:
        self.state, self.parser, self.parallel = state, parser, parallel
        self.sent: dict[int, int] = {}  # streaming: characters of content handed out per choice

    def split(self, out: RequestOutput) -> tuple[str | None, list, str | None]:
        """(content, tool calls, finish reason) of a finished output."""
        if self.parser is None:
            return out.text, [], out.finish_reason
        content, calls = self.parser.parse(out.text, out.output_token_ids, self.state.tokenizer)
        if not self.parallel:
            calls = calls[:1]
        reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        return content, calls, reason

    def delta(self, index: int, out: RequestOutput) -> str:
        """Streaming: the content this step may show (text that may open a call is held)."""
        if self.parser is None:
            return out.new_text
        sent = self.sent.get(index, 0)
        end = self.parser.content_end(out.text, out.output_token_ids, self.state.tokenizer)
        if end <= sent:
            return ""
        self.sent[index] = end
        return out.text[sent:end]

    def rest(self, index: int, out: RequestOutput) -> tuple[str, list[DeltaToolCall], str | None]:
        """Streaming, at the finish: content still held, the calls, the finish reason."""
        if self.parser is None:
            return "", [], out.finish_reason
        content, calls, reason = self.split(out)
        sent = self.sent.get(index, 0)
        tail = (content or "")[sent:] if calls else out.text[sent:]
        deltas = [DeltaToolCall(index=i, **c.model_dump()) for i, c in enumerate(calls)]
        return tail, deltas, reason


async def _events(
    state: ServerState,
    stream: RequestStream,
    response_id: str,
    created: int,
    model: str,
    n: int,
    prompt_len: int,
    include_usage: bool,
    calls: _CallSplitter,
) -> AsyncIterator[str]:
    """SSE chunks: a role chunk per choice, content deltas (tool calls at the end), a finish chunk,
    usage, ``[DONE]``."""

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
            text = calls.delta(index, out)
            if text or lps is not None:
                yield chunk([ChatStreamChoice(index=index, delta=ChatDelta(content=text), logprobs=lps)])
            if out.finished:
                finals.append(out)
                tail, tool_calls, reason = calls.rest(index, out)
                if tail or tool_calls:
                    delta = ChatDelta(content=tail or None, tool_calls=tool_calls or None)
                    yield chunk([ChatStreamChoice(index=index, delta=delta)])
                yield chunk([ChatStreamChoice(index=index, delta=ChatDelta(), finish_reason=reason)])
        if include_usage:
            yield chunk([], usage=usage([prompt_len], finals, n).model_dump())
    except APIError as exc:
        yield sse_event(exc.body())
    yield DONE
