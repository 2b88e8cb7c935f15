"""Tokenizer wrapper over the ``tokenizers`` library (``tokenizer.json``), plus chat templates.

Special tokens come from ``tokenizer_config.json`` when present. A chat template there (jinja) is
used for ``/v1/chat/completions``; without one, :data:`FALLBACK_CHAT_TEMPLATE` is used, which
renders ``<role>: content`` lines followed by ``assistant:``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        self.chat_template: str | None = self.config.get("chat_template") or None
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as it would appear alone (for logprobs' ``tokens``)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages (``[{"role", "content"}]``) into one prompt string."""
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        template = env.from_string(self.chat_template or FALLBACK_CHAT_TEMPLATE)
        extra = {k: self._special(self.config.get(k)) or "" for k in ("bos_token", "eos_token")}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
