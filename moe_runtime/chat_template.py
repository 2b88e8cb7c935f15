"""Chat-template rendering as transformers does it, without importing transformers.

A checkpoint's chat template is untrusted code, so it runs in jinja's
``ImmutableSandboxedEnvironment`` (``{{ ''.__class__ }}`` raises ``jinja2.SecurityError``). The
environment and the variables are those of transformers' ``apply_chat_template``
(``transformers/utils/chat_template_utils.py``, ``render_jinja_template``), so a template renders
byte-identical to transformers (``tests/test_chat_template.py`` checks this on Qwen3-, Mixtral- and
DeepSeek-style templates):

- environment: ``trim_blocks=True``, ``lstrip_blocks=True``, the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``), default (lenient) undefined values;
- globals: ``raise_exception(message)`` (raises :class:`jinja2.TemplateError`),
  ``strftime_now(format)`` (local time), ``dict`` and ``namespace`` restricted as transformers
  restricts them (no underscore-prefixed namespace attributes);
- the ``tojson`` filter is ``json.dumps`` with ``ensure_ascii=False`` and the options
  ``indent``, ``separators``, ``sort_keys`` (jinja's own escapes HTML);
- variables: ``messages`` (``None``-valued keys dropped; ``reasoning_content`` filled from
  ``thinking``/``reasoning`` and copied to ``thinking``), ``tools`` (``None`` when absent),
  ``documents``, ``add_generation_prompt``, the tokenizer's special tokens, then any template
  kwargs (``enable_thinking`` for Qwen3), which override special tokens of the same name;
- ``continue_final_message``: the last message is left open so the model continues it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moe_runtime.errors import RequestError

#: Names the renderer sets itself; template kwargs may not take them.
RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
#: Names a message's reasoning goes by; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(RequestError, jinja2.TemplateError):
    """The messages or options cannot be rendered by this template (HTTP 400, param ``messages``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: builds dicts, exposes nothing of the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attributes (no route to dunders)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (cached per source text).

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A copy made of JSON types only (anything else becomes ``"<TypeName>"``), as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is not an object")
        m = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` (OpenAI-style dicts: ``role``, ``content``, ``tool_calls``, ...) to text.

    Returns the prompt string (tokenize it without adding special tokens).

    Raises:
        ChatTemplateError: bad options (``continue_final_message`` with ``add_generation_prompt``,
            a reserved template kwarg, a final message the template drops) or a Python error
            inside the template.
        jinja2.TemplateError: the template raised (``raise_exception``), hit an undefined value
            it cannot use, or tried an unsafe operation (``jinja2.SecurityError``).
    """
    template_kwargs = dict(template_kwargs or {})
    if bad := sorted(RESERVED_NAMES & template_kwargs.keys()):
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(bad)}")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("every tool must be a JSON object")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("every document must be a JSON object")
    chat = _messages(messages)
    final = None
    if continue_final_message:
        final = chat[-1].get("content") if chat else None
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message with text content")
        chat[-1]["content"] = final + _CONTINUE_TAG
    variables = {**dict(special_tokens or {}), **_plain(template_kwargs)}
    template = compile_template(source)
    try:
        text = template.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError:
        raise
    except Exception as exc:  # a template's own bug, e.g. adding a string to a list
        raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
    if final is not None:
        text = _cut_at_continue_tag(text, final)
    return text


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the template drops part of the final message")
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space
