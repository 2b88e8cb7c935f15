"""Structured output: a grammar per sequence (llguidance), a token mask per step for the sampler.

``response_format`` ``json_object`` / ``json_schema`` become an llguidance grammar
(:func:`json_grammar`); the engine keeps one :class:`GrammarMatcher` per sequence, asks it for
the allowed tokens before each sample (a bool mask ``[V]``) and feeds it each sampled token. The
matcher allows EOS only where the JSON is complete, and stops the sequence when nothing may follow.

Why llguidance: a wheel with no dependencies for CPython 3.9+ (abi3) that builds its token trie
straight from a ``tokenizer.json`` string (what ``tokenizers`` gives), computes masks fast
(``docs/server.md`` has a measurement), and supports JSON Schema well (vLLM and SGLang ship it
as a backend). xgrammar requires torch, transformers and triton and a transformers tokenizer
object; outlines-core compiles a whole-vocabulary index per schema up front.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from moe_runtime.errors import RequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON layout the grammar allows: no free whitespace (a sampled model cannot pad forever). A
schema's own ``"x-guidance"`` options are replaced by these."""


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar for JSON matching ``schema`` (``None``: any JSON object), laid out
    as :data:`JSON_OPTIONS` says whatever ``"x-guidance"`` the schema carries.

    Raises:
        RequestError: ``schema`` is not a JSON object llguidance can read.
    """
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"the JSON schema cannot be used: {exc}") from None


def lark_grammar(lark: str) -> str:
    """The llguidance grammar for a Lark grammar (``%json {schema}`` rules allowed; give them
    ``"x-guidance": JSON_OPTIONS`` for the same layout as :func:`json_grammar`)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


_TOKENIZERS: dict[int, Any] = {}
_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's tokenizer for ``tokenizer`` (built once per tokenizer object, ~30 ms)."""
    import llguidance

    key = id(tokenizer)
    with _LOCK:
        entry = _TOKENIZERS.get(key)
        if entry is None or entry[0] is not tokenizer:
            ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos_token_ids)
            entry = _TOKENIZERS[key] = (tokenizer, ll)
        return entry[1]


class GrammarMatcher:
    """One sequence's position in its grammar.

    Args:
        grammar: from :func:`json_grammar`.
        tokenizer: the checkpoint's :class:`~moe_runtime.tokenizer.Tokenizer`.
        vocab_size: the model's logit width ``V`` (may exceed the tokenizer's).
        eos_token_ids: the ids that end a sequence; allowed once the grammar accepts.

    Raises:
        RequestError: the grammar does not compile (e.g. an unsupported schema keyword).
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        if tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer.json")
        self.vocab_size = vocab_size
        ll = _ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self._m = llguidance.LLMatcher(ll, grammar, log_level=0)
        if self._m.is_error():
            raise RequestError(f"the grammar cannot be used: {self._m.get_error()}")

    def allowed(self) -> torch.Tensor:
        """Bool mask ``[V]`` of the tokens the grammar allows next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))

    def consume(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            RequestError: the grammar does not allow ``token`` (the sequence then fails alone).
        """
        if not self._m.consume_token(token):
            raise RequestError(f"token {token} breaks the grammar: {self._m.get_error()}")

    @property
    def finished(self) -> bool:
        """True when no further token may follow (the output is complete)."""
        return self._m.is_stopped()


def check_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
    """Compile ``grammar`` once to refuse a bad schema before queueing (raises ``RequestError``)."""
    GrammarMatcher(grammar, tokenizer, vocab_size, eos_token_ids)
