"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (the replay client sizes prompts here).

``/tokenize`` takes either ``{"prompt", "add_special_tokens"=true}`` or a chat request
``{"messages", "add_generation_prompt"=true, "continue_final_message", "tools",
"chat_template", "chat_template_kwargs", "add_special_tokens"=false}`` (rendered with the chat
template exactly as ``/v1/chat/completions`` renders it) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs=true``, else null). ``/detokenize`` takes ``{"tokens": [ids]}`` and answers
``{"prompt": text}``. Both need the API key when one is set.
"""

from __future__ import annotations

from typing import Any

import jinja2
from fastapi import APIRouter, Request
from pydantic import BaseModel

from server.errors import invalid
from server.protocol import ChatMessage, _Request
from server.routes.chat import chat_prompt
from server.routes.common import check_model, get_state, tokenize
from server.routes.limits import check_token_ids


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def make_router() -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_text(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state = get_state(request)
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("send exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenize(state, body.prompt, "prompt", add_special_tokens=special)
        else:
            ids = _chat_ids(state, body)
        strs = [state.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
        )

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = get_state(request)
        check_model(state, body.model)
        check_token_ids(state, body.tokens, "tokens")
        if state.tokenizer is None:
            raise invalid("this model has no tokenizer.json", "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

    return router


def _chat_ids(state: Any, body: TokenizeRequest) -> list[int]:
    messages = body.messages or []
    if state.tokenizer is None:
        raise invalid("this model has no tokenizer.json", "messages")
    try:
        text = chat_prompt(state, body, messages, body.tools)
    except jinja2.TemplateError as exc:
        raise invalid(f"the chat template failed on these messages: {exc}", "messages") from None
    return tokenize(state, text, "messages", add_special_tokens=bool(body.add_special_tokens))
