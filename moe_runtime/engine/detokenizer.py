"""Incremental detokenization with stop strings.

Each step the output ids are decoded again (fast in the ``tokenizers`` library) and the new text
is handed out as a delta, holding back (a) a trailing replacement character, which means a
multi-byte character is not complete yet, and (b) any tail that could still grow into a stop string.
"""

from __future__ import annotations

from moe_runtime.engine.request import Sequence
from moe_runtime.tokenizer import Tokenizer


def update_text(seq: Sequence, tokenizer: Tokenizer | None) -> bool:
    """Refresh ``seq.output_text``; returns True when a stop string was found (text cut before it)."""
    if tokenizer is None:
        return False
    text = tokenizer.decode(seq.output_token_ids)
    stops = seq.params.stop
    if stops:
        cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
        if cut >= 0:
            seq.output_text = text[:cut]
            return True
    seq.output_text = text
    return False


def take_delta(seq: Sequence, finished: bool) -> str:
    """Text not yet handed out; on an unfinished sequence, minus the undecided tail."""
    text = seq.output_text
    end = len(text)
    if not finished:
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        end = max(seq.sent_text_len, end - hold)
        while end > seq.sent_text_len and text[end - 1] == "\ufffd":
            end -= 1
    delta = text[seq.sent_text_len : end]
    seq.sent_text_len = end
    return delta
