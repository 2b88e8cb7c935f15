"""Tool calls parsed out of a model's output, for the chat template families whose format is known.

========  =====================================================  ==================================
parser    chosen when the chat template contains                 output format
========  =====================================================  ==================================
qwen      ``<tool_call>`` (Qwen2.5/Qwen3, Hermes)                ``<tool_call>\\n{"name": ...,
                                                                 "arguments": {...}}\\n</tool_call>``
                                                                 repeated; text before is content
mistral   ``[TOOL_CALLS]`` (Mistral/Mixtral-Instruct v0.3+)      ``[TOOL_CALLS][{"name": ...,
                                                                 "arguments": {...}}, ...]``
========  =====================================================  ==================================

A template with neither has no parser: a request with ``tools`` (and ``tool_choice`` other than
``"none"``) is refused with 400 rather than answered with calls nobody can read. Output that
starts a call but is not valid JSON is returned as plain content.

``tool_choice`` ``"required"`` or a named function is enforced with a grammar
(:meth:`ToolParser.forced_grammar`): the output is one ``<tool_call>`` block (``parallel_tool_calls``
false) or 1 to :data:`MAX_PARALLEL_CALLS` blocks whose JSON matches the tools' parameter schemas,
and then the sequence ends (``finish_reason`` ``"tool_calls"``). Only the Qwen format has one
(Mistral's marker is a special token a text grammar cannot write).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from moe_runtime.engine.structured import JSON_OPTIONS, lark_grammar
from moe_runtime.tokenizer import Tokenizer
from server.protocol import FunctionCall, ToolCall

MAX_PARALLEL_CALLS = 4
"""The most calls a forced ``tool_choice`` (``"required"`` or a named function) may write when
``parallel_tool_calls`` is true (false: exactly one), so its output always ends."""


@dataclass(frozen=True, slots=True)
class ToolParser:
    """Splits output into content and tool calls.

    Attributes:
        name: ``"qwen"`` or ``"mistral"``.
        marker: the text that opens the calls.
        marker_id: the marker's token id when it is a special token (decoding skips it, so it
            is found among the output token ids instead of in the text).
    """

    name: str
    marker: str
    marker_id: int | None

    def content_end(self, text: str, token_ids: list[int], tokenizer: Tokenizer) -> int:
        """How many leading characters of ``text`` are content for sure (streaming).

        Text from the marker on is held back; so is a tail that may be the start of a marker.
        """
        start = self._start(text, token_ids, tokenizer)
        if start is not None:
            return start
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def parse(
        self, text: str, token_ids: list[int], tokenizer: Tokenizer
    ) -> tuple[str | None, list[ToolCall]]:
        """(content or None, tool calls) of a finished output; no calls when none parse."""
        start = self._start(text, token_ids, tokenizer)
        if start is None:
            return text, []
        calls_text = self._calls_text(text, start, token_ids, tokenizer)
        calls = _qwen_calls(calls_text) if self.name == "qwen" else _mistral_calls(calls_text)
        if calls is None:
            return text, []
        content = text[:start].rstrip()
        return content or None, [self._call(name, args) for name, args in calls]

    def forced_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str | None:
        """A grammar that makes the output calls of ``tools`` and nothing else (None for formats
        without one); it is compiled (and a bad ``parameters`` schema found) when a matcher is
        built from it.

        The output is one ``<tool_call>`` block, or with ``parallel`` 1 to
        :data:`MAX_PARALLEL_CALLS` blocks joined by ``\\n``; after the last allowed block only
        EOS may follow, so the sequence ends there (``finish_reason`` ``"tool_calls"``). The JSON
        has a fixed layout (:data:`~moe_runtime.engine.structured.JSON_OPTIONS`: no free
        whitespace); only a schema with unbounded values (a string without ``maxLength``, an
        object with free ``additionalProperties``) still lets a call run to ``max_tokens``.
        """
        if self.name != "qwen":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
        repeat = f' ("\\n" block){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        block = 'block: "<tool_call>\\n" call "\\n</tool_call>"'
        lark = f"start: block{repeat}\n{block}\ncall: %json {json.dumps(schema)}"
        return lark_grammar(lark)

    def _start(self, text: str, token_ids: list[int], tokenizer: Tokenizer) -> int | None:
        if self.marker_id is not None and self.marker_id in token_ids:
            return min(len(text), len(tokenizer.decode(token_ids[: token_ids.index(self.marker_id)])))
        start = text.find(self.marker)
        return None if start < 0 else start

    def _calls_text(self, text: str, start: int, token_ids: list[int], tokenizer: Tokenizer) -> str:
        if self.marker_id is not None and self.marker_id in token_ids:
            return tokenizer.decode(token_ids[token_ids.index(self.marker_id) + 1 :])
        return text[start:] if self.name == "qwen" else text[start + len(self.marker) :]

    def _call(self, name: str, arguments: object) -> ToolCall:
        if self.name == "mistral":  # Mistral's templates require 9 alphanumeric characters
            call_id = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        else:
            call_id = f"call_{secrets.token_hex(12)}"
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=args))


_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _qwen_calls(text: str) -> list[tuple[str, object]] | None:
    calls = []
    for body in _QWEN_CALL.findall(text):
        call = _name_args(body)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _mistral_calls(text: str) -> list[tuple[str, object]] | None:
    text = text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_name_args(item) for item in items]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _name_args(body: str | object) -> tuple[str, object] | None:
    """``{"name": str, "arguments": object}`` (JSON text or parsed) -> (name, arguments)."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get("arguments", body.get("parameters", {}))
    return body["name"], args


def tool_parser(tokenizer: Tokenizer, template_source: str) -> ToolParser | None:
    """The parser for the family ``template_source`` is written for, or None when none fits."""
    for name, marker in (("qwen", "<tool_call>"), ("mistral", "[TOOL_CALLS]")):
        if marker in template_source:
            token_id = tokenizer.token_id(marker)
            special = token_id is not None and tokenizer.decode([token_id]) == ""
            return ToolParser(name, marker, token_id if special else None)
    return None
