"""A byte-level BPE tokenizer of exactly ``vocab_size`` ids, so every id a model emits decodes.

It starts from the bundled model's tokenizer (``moe_runtime/assets/tiny-moe``: 4 special tokens,
the 256 byte symbols, then merges trained on English, code and exam text) and

- pads a larger vocabulary with ``<|reserved_N|>`` tokens: plain BPE vocabulary entries that no
  merge produces (encoding never emits them) and that decode to their own text;
- truncates a smaller one to its first ``vocab_size`` ids, keeping only the merges whose parts and
  result survive.

The special tokens (``<|endoftext|>`` = 0, EOS and padding) and the chat template are the bundled
model's (:mod:`moeserve.train.tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_runtime.errors import ConfigError


def _bundled() -> dict:
    from moe_runtime.assets import default_model_dir

    return json.loads((Path(default_model_dir()) / "tokenizer.json").read_text())


def sized_tokenizer(vocab_size: int):
    """The bundled tokenizer padded or truncated to ``vocab_size`` ids.

    Returns:
        ``tokenizers.Tokenizer`` with ``get_vocab_size() == vocab_size``.

    Raises:
        ConfigError: ``vocab_size`` below the special tokens plus the 256 byte symbols.
    """
    from tokenizers import Tokenizer

    data = _bundled()
    model = data["model"]
    vocab: dict[str, int] = model["vocab"]
    floor = len(data["added_tokens"]) + 256
    if vocab_size < floor:
        raise ConfigError(f"vocab_size {vocab_size}: a byte-level tokenizer needs at least {floor} ids")
    if vocab_size <= len(vocab):
        vocab = {t: i for t, i in vocab.items() if i < vocab_size}
        merges = [m for m in model["merges"] if _merge_kept(m, vocab)]
    else:
        vocab = dict(vocab)
        merges = model["merges"]
        for i in range(len(vocab), vocab_size):
            vocab[f"<|reserved_{i}|>"] = i
    model["vocab"], model["merges"] = vocab, merges
    tok = Tokenizer.from_str(json.dumps(data))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def _merge_kept(merge, vocab: dict[str, int]) -> bool:
    a, b = merge.split(" ") if isinstance(merge, str) else merge
    return a in vocab and b in vocab and a + b in vocab


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of :func:`sized_tokenizer` to ``out_dir``."""
    from moeserve.train.tokenizer import save_tokenizer

    save_tokenizer(sized_tokenizer(vocab_size), out_dir, model_max_length)
