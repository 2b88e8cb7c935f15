"""Value and size limits of a request, checked before anything is tokenized, allocated or queued.

Every check is O(size of the field) on what the body already holds, and every violation is a 400
``invalid_value`` naming the field (``param``). The limits (also in ``docs/server.md``):

=====================  ==========================================================================
field                  limit
=====================  ==========================================================================
``temperature``        finite, in [0, 2] (OpenAI's range); below 1e-5 the request is greedy
``top_p``              finite, in (0, 1]; the most likely token is always kept
``top_k``              -1, 0 (off) or positive
``n`` x prompts        at most ``--max-batch-size + --max-queue`` sequences, counted before any
                       prompt is tokenized
``max_tokens``         >= 1 (more than the context leaves ends with ``finish_reason="length"``)
``stop``               at most 4 strings (OpenAI), each at most 256 characters
``stop_token_ids``     at most 64, each a token id of the vocabulary
``logprobs``           0..20 (chat: ``top_logprobs``)
``presence_penalty``   finite, in [-2, 2] (OpenAI); also ``frequency_penalty``
``repetition_penalty`` finite, in (0, 2]
``min_p``              finite, in [0, 1]
``logit_bias``         at most 300 entries (OpenAI); keys token ids of the vocabulary, values in
                       [-100, 100]
``seed``               a signed 64-bit integer (a schema bound: ``server/protocol.py``)
prompt token ids       in [0, vocabulary size)
any text               valid Unicode (no lone surrogates such as ``"\\ud800"``)
=====================  ==========================================================================
"""

from __future__ import annotations

import math

from server.errors import APIError, invalid
from server.protocol import SamplingFields
from server.state import ServerState

MAX_TEMPERATURE = 2.0
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100.0


def check_text(text: str, param: str) -> None:
    """400 when ``text`` cannot be UTF-8 encoded (a lone surrogate from a JSON ``\\ud800`` escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            f"{param} is not valid Unicode: lone surrogate at character {exc.start}", param
        ) from None


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    """400 when an id is outside ``[0, vocabulary size)``."""
    vocab = state.client.engine.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"{param}: token id {bad} is out of range [0, {vocab})", param)


def check_sampling(state: ServerState, body: SamplingFields, num_prompts: int) -> None:
    """The value and size limits of the module table shared by both routes.

    Raises:
        APIError: 400 naming the first field over its limit.
    """
    if body.n < 1:
        raise invalid(f"n must be >= 1, got {body.n}", "n")
    client = state.client
    most = client.max_batch_size + client.max_queue
    if body.n * num_prompts > most:
        msg = (
            f"the request needs {body.n * num_prompts} sequences (prompts x n); this server holds at "
            f"most {most} (--max-batch-size + --max-queue)"
        )
        raise APIError(400, msg, "invalid_value", "n")
    t = body.temperature
    if t is not None and not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        raise invalid(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t}", "temperature")
    if body.top_p is not None and not (math.isfinite(body.top_p) and 0 < body.top_p <= 1):
        raise invalid(f"top_p must be a number in (0, 1], got {body.top_p}", "top_p")
    if body.top_k is not None and body.top_k < -1:
        raise invalid(f"top_k must be -1, 0 or positive, got {body.top_k}", "top_k")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP:
        raise invalid(f"stop allows at most {MAX_STOP} strings, got {len(stops)}", "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise invalid(f"a stop string is {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
        check_text(s, "stop")
    _check_processors(state, body)
    if body.stop_token_ids:
        if len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            msg = f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(body.stop_token_ids)}"
            raise invalid(msg, "stop_token_ids")
        check_token_ids(state, body.stop_token_ids, "stop_token_ids")


def _in_range(value: float | None, low: float, high: float, param: str, low_open: bool = False) -> None:
    if value is None:
        return
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise invalid(f"{param} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}", param)


def _check_processors(state: ServerState, body: SamplingFields) -> None:
    """Penalties, ``min_p`` and ``logit_bias`` (the logits processors' inputs)."""
    _in_range(body.presence_penalty, -2, 2, "presence_penalty")
    _in_range(body.frequency_penalty, -2, 2, "frequency_penalty")
    _in_range(body.repetition_penalty, 0, 2, "repetition_penalty", low_open=True)
    _in_range(body.min_p, 0, 1, "min_p")
    bias = body.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias allows at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    ids = []
    for key, value in bias.items():
        try:
            ids.append(int(key))
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias") from None
        _in_range(value, -MAX_BIAS, MAX_BIAS, "logit_bias")
    check_token_ids(state, ids, "logit_bias")


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)
