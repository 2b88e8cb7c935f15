"""Incremental detokenization with stop strings (vLLM's prefix/read offsets).

Per step only a short window of output tokens is decoded: ``ids[prefix_offset:read_offset]`` is
text already settled, ``ids[prefix_offset:]`` the same plus the new tokens; the difference is the
new text. Decoding from ``prefix_offset`` rather than from the new token gives the tokenizer the
context it needs (leading spaces, byte-level merges). A window whose text ends in a replacement
character is a multi-byte character not yet complete: it waits for the next token, and is flushed
as it stands when the sequence finishes (:func:`finish_text`).

Stop strings are searched only in the new text plus the ``longest stop - 1`` characters before
it: earlier text was searched already. Deltas hold back any tail that could still grow into a stop
string. Per step the cost is therefore independent of the output length.
"""

from __future__ import annotations

from moe_runtime.engine.request import Sequence
from moe_runtime.tokenizer import Tokenizer


def _window_text(seq: Sequence, tokenizer: Tokenizer) -> str:
    """Text of the tokens after ``read_offset`` (may end in an incomplete character)."""
    ids = seq.output_token_ids
    settled = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
    full = tokenizer.decode(ids[seq.prefix_offset :])
    return full[len(settled) :] if len(full) > len(settled) else ""


def update_text(seq: Sequence, tokenizer: Tokenizer | None) -> bool:
    """Add the new tokens' settled text to ``seq.output_text``; True when a stop string was found
    (the text is then cut before it)."""
    if tokenizer is None:
        return False
    new = _window_text(seq, tokenizer)
    if not new or new.endswith("\ufffd"):
        return False
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.output_token_ids)
    return _append(seq, new)


def finish_text(seq: Sequence, tokenizer: Tokenizer | None) -> None:
    """On finishing (not by a stop string): add any text still waiting, incomplete or not."""
    if tokenizer is None or seq.read_offset == len(seq.output_token_ids):
        return
    new = _window_text(seq, tokenizer)
    seq.prefix_offset = seq.read_offset = len(seq.output_token_ids)
    _append(seq, new)


def _append(seq: Sequence, new: str) -> bool:
    """Append ``new``; search the stops in the tail window; cut at the earliest match."""
    start = len(seq.output_text)
    seq.output_text += new
    stops = seq.params.stop
    if not stops:
        return False
    lo = max(0, start - max(len(s) for s in stops) + 1)
    text = seq.output_text
    cut = min((i for i in (text.find(s, lo) for s in stops if s) if i >= 0), default=-1)
    if cut >= 0:
        seq.output_text = text[:cut]
        return True
    return False


def take_delta(seq: Sequence, finished: bool) -> str:
    """Text not yet handed out; on an unfinished sequence, minus the undecided tail."""
    text = seq.output_text
    end = len(text)
    if not finished:
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        end = max(seq.sent_text_len, end - hold)
    delta = text[seq.sent_text_len : end]
    seq.sent_text_len = end
    return delta
