"""Tokenizer wrapper over the ``tokenizers`` library (``tokenizer.json``), plus chat templates.

Special tokens come from ``tokenizer_config.json`` when present. Chat templates are found where
transformers finds them: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` in the
checkpoint folder first, else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}``). They render through :mod:`moe_runtime.chat_template` (sandboxed, the
variables transformers gives). Without any template, :data:`FALLBACK_CHAT_TEMPLATE` is used, which
renders ``<role>: content`` lines followed by ``assistant:``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from moe_runtime.chat_template import ChatTemplateError, compile_template, render_chat_template
from moe_runtime.errors import CheckpointError

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class Tokenizer:
    """Text <-> token ids for one checkpoint folder.

    Raises:
        CheckpointError: ``tokenizer.json`` or ``tokenizer_config.json`` cannot be parsed.
    """

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception subclasses
            raise CheckpointError(f"{path}: cannot load tokenizer ({exc})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_path.exists():
            try:
                self.config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{cfg_path}: invalid JSON ({exc})") from None
        #: Named chat templates (``"default"``, ``"tool_use"``, ...); empty without any.
        self.chat_templates: dict[str, str] = _load_chat_templates(model_dir, self.config)
        for name, source in self.chat_templates.items():
            try:
                compile_template(source)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"{model_dir}: chat template {name!r} does not parse ({exc})") from None
        self.chat_template: str | None = self.chat_templates.get("default")
        #: Special tokens a template sees (``bos_token``, ``eos_token``, ... every ``*_token`` string).
        self.special_tokens: dict[str, str] = {
            key: token
            for key, value in self.config.items()
            if key.endswith("_token")
            and (token := self._special(value)) is not None
            and isinstance(token, str)
        }
        self.eos_token_ids: list[int] = []
        eos = self._special(self.config.get("eos_token"))
        if eos is not None and (tid := self._tok.token_to_id(eos)) is not None:
            self.eos_token_ids.append(tid)

    @staticmethod
    def _special(value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get("content")
        return value

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` as one vocabulary entry (added tokens included), or None."""
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The whole ``tokenizers`` tokenizer as a JSON string (for grammar libraries)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as it would appear alone (for logprobs' ``tokens``)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render chat messages into one prompt string, as transformers' ``apply_chat_template``.

        Args:
            messages: whole OpenAI-style message dicts (``role``, ``content``, and ``name``,
                ``tool_calls``, ``tool_call_id``, ``reasoning_content`` ... passed through to the
                template; ``None`` values are dropped).
            add_generation_prompt: end with the assistant turn's header (default true, unlike
                transformers, because serving always generates the next turn).
            tools: JSON tool schemas (``{"type": "function", "function": {...}}``), or ``None``.
            documents: retrieval documents for templates that read them.
            continue_final_message: leave the last message open for the model to continue.
            chat_template: the name of one of :attr:`chat_templates`, or a template's source; by
                default ``"tool_use"`` when tools are given and the checkpoint has it, else ``"default"``.
            chat_template_kwargs: extra template variables (``{"enable_thinking": False}`` for
                Qwen3), as a request's ``chat_template_kwargs`` gives them.
            template_kwargs: more template variables, as keywords; they override the former.

        Raises:
            ChatTemplateError: unknown template name or bad options (see
                :func:`moe_runtime.chat_template.render_chat_template`).
            jinja2.TemplateError: the template refused the messages or tried an unsafe operation.
        """
        source = self.template_source(chat_template, tools)
        return render_chat_template(
            source,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=self.special_tokens,
            template_kwargs={**(chat_template_kwargs or {}), **template_kwargs},
        )

    def template_source(self, name: str | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The source of the template a request with ``chat_template=name`` and ``tools`` renders with.

        Raises:
            ChatTemplateError: unknown name, or several templates and no default.
        """
        templates = self.chat_templates
        if name is not None:
            if name in templates:
                return templates[name]
            if "{" in name:  # a template's source, as transformers accepts
                return name
            raise ChatTemplateError(
                f"unknown chat template {name!r}; this model has {sorted(templates) or 'none'}"
            )
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if templates:
            raise ChatTemplateError(
                f"this model has several chat templates and no default; name one of {sorted(templates)}"
            )
        return FALLBACK_CHAT_TEMPLATE


def _load_chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates from ``chat_template.jinja`` / ``additional_chat_templates/`` or the config.

    Raises:
        CheckpointError: ``chat_template`` in the config is neither a string nor a list of
            ``{"name", "template"}`` objects.
    """
    templates: dict[str, str] = {}
    if (path := model_dir / "chat_template.jinja").is_file():
        templates["default"] = path.read_text(encoding="utf-8")
    if (folder := model_dir / "additional_chat_templates").is_dir():
        for path in sorted(folder.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    value = config.get("chat_template")
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {"default": value}
    where = f"{model_dir / 'tokenizer_config.json'}: chat_template"
    if not isinstance(value, list):
        raise CheckpointError(f"{where} must be a string or a list of {{name, template}} objects")
    for item in value:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("template"), str)
        ):
            raise CheckpointError(f"{where} must be a string or a list of {{name, template}} objects")
        templates[item["name"]] = item["template"]
    return templates
