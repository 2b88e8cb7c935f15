"""OpenAI-compatible request and response schemas (pydantic), plus our extension fields.

Requests are checked for *shape* here; *values* (ranges, sizes, unsupported options) are checked
by the routes (``server/routes/limits.py``) before any work. Both are answered with 400 and the
field in ``param``, as the OpenAI API and vLLM do. Unknown request fields are ignored.

Extensions beyond the OpenAI schema (vLLM's names; send them with the client's ``extra_body``):
    requests: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``;
    chat: ``chat_template_kwargs``, ``continue_final_message``, ``add_generation_prompt``,
    ``chat_template``, ``documents``.
    responses: ``usage.expert_stats = {buffer_hits, buffer_misses, blocking_ms, cpu_experts,
    cpu_expert_ms, bytes_not_moved}`` for the request (summed over its choices; the last three are
    hybrid expert execution's, ``moe_runtime.hybrid``); ``/v1/models`` entries carry ``max_model_len``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
"""A signed 64-bit integer (``seed``); out of range is a 400 naming the field."""

_NULL_IS_A_VALUE = {"max_tokens"}  # completions: null = the rest of the context, not 16


class _Request(BaseModel):
    """Unknown fields are ignored; ``null`` means "the default" (OpenAI clients send it)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in _NULL_IS_A_VALUE}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: ``schema`` is the JSON Schema the output must validate."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Request):
    """Fields common to completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The message roles the OpenAI chat API knows."""


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One message; the tool and reasoning fields go to the chat template as they are. ``role`` is
    one of :data:`MESSAGE_ROLES` (checked by the route: another is a 400 naming
    ``messages.<i>.role``)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: rendered with the checkpoint's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


# ---------------------------------------------------------------------------- responses
class ExpertUsage(BaseModel):
    """Our extension: expert-buffer figures of one request (``RequestOutput.expert_stats``)."""

    buffer_hits: int = 0
    buffer_misses: int = 0
    blocking_ms: float = 0.0
    # hybrid expert execution (moe_runtime.hybrid): misses computed on the CPU, their CPU time,
    # and the copy bytes they avoided
    cpu_experts: int = 0
    cpu_expert_ms: float = 0.0
    bytes_not_moved: int = 0


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens`` came from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    expert_stats: ExpertUsage = Field(default_factory=ExpertUsage)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int


def _is_none(value: object) -> bool:
    return value is None


class AssistantMessage(BaseModel):
    """The reply; ``tool_calls`` is left out of the JSON when the reply has none (as OpenAI does)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """A streamed piece of the reply; fields that are None are left out of the JSON."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
