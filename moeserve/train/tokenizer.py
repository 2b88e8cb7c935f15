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

Tool calls use the Qwen2.5/Qwen3 (Hermes) format, so the server's ``<tool_call>`` parser and its
``tool_choice`` grammar apply (no training row uses it: the model calls tools reliably only under
that grammar). With ``tools`` the first turn is ``<|system|>\\n``, the system message and ``\\n\\n`` (if
any), ``# Tools`` ... ``<tools>`` with one JSON tool per line, then the call format; an assistant
message with ``tool_calls`` is its content (if any) + ``\\n``, then
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call (``\\n`` between),
then EOS; consecutive ``tool`` messages form one ``<|user|>`` turn of
``\\n<tool_response>\\n{content}\\n</tool_response>`` pieces. Messages without tools or tool
calls render exactly as above.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, *ROLE_TOKENS)
# Every tag strips the whitespace before it (``{%-``, ``{{-``) and newlines are jinja string literals:
# transformers renders with ``trim_blocks=True``, :func:`render_chat` without; this renders the same
# in both, and the source may be laid out on several lines.
CHAT_TEMPLATE = r"""{%- set has_tools = tools is defined and tools %}
{%- if has_tools %}
    {{- '<|system|>\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if has_tools and loop.first and message['role'] == 'system' %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
        {{- '<|assistant|>\n' }}
        {%- if message['content'] is defined and message['content'] %}
            {{- message['content'] + '\n' }}
        {%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- set function = call['function'] if call['function'] is defined else call %}
            {%- if not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + function['name'] + '", "arguments": ' }}
            {%- if function['arguments'] is string %}
                {{- function['arguments'] }}
            {%- else %}
                {{- function['arguments'] | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- eos_token + '\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|user|>' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|' + message['role'] + '|>\n' + message['content'] }}
        {%- if message['role'] == 'assistant' %}
            {{- eos_token }}
        {%- endif %}
        {{- '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
{%- endif %}"""


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
