"""Byte-level BPE tokenizer of the bundled tiny MoE, and its chat template.

The tokenizer is trained with the ``tokenizers`` library on an equal-size sample of each domain's
*training* documents (never held-out text), so code, prose and exam text all get merges.

Chat template (jinja, stored as ``chat_template`` in ``tokenizer_config.json``)::

    <|user|>
    {user message}
    <|assistant|>
    {assistant message}<|endoftext|>

Every message is ``<|{role}|>\\n{content}\\n`` (roles ``system``, ``user``, ``assistant``; the three
role markers are single special tokens); an assistant message ends with the EOS token
``<|endoftext|>``. With ``add_generation_prompt`` the text ends in ``<|assistant|>\\n``. Half of the
QA training rows are rendered this way, so the trained model answers after ``<|assistant|>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, *ROLE_TOKENS)
# Newlines are jinja string literals, never raw text after a block tag: transformers renders with
# ``trim_blocks=True`` (which drops such a newline), our runtime without; this renders the same in both.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def _compiled_template():
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(CHAT_TEMPLATE)


def render_chat(
    messages: list[dict[str, str]], add_generation_prompt: bool = False, eos_token: str = EOS_TOKEN
) -> str:
    """Render ``[{"role", "content"}]`` with :data:`CHAT_TEMPLATE` (exactly as the runtime does)."""
    return _compiled_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt, eos_token=eos_token, bos_token=""
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style pre-tokenizer, no normaliser) of ``vocab_size`` ids.

    Returns:
        ``tokenizers.Tokenizer`` whose first ids are :data:`SPECIAL_TOKENS` (``<|endoftext|>`` = 0).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (EOS/pad token, chat template)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
