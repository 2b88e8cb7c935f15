"""``response_format`` -> the llguidance grammar the engine enforces (``moe_runtime.engine.structured``).

``text`` (or no field) needs no grammar; ``json_object`` allows any JSON object;
``json_schema`` allows JSON valid against ``json_schema.schema``. A schema the grammar compiler
cannot use, or any other type, is a 400 naming ``response_format``: the field is never ignored.
"""

from __future__ import annotations

from moe_runtime.engine.structured import check_grammar, json_grammar
from moe_runtime.errors import RequestError
from server.errors import invalid
from server.protocol import SamplingFields
from server.state import ServerState


def response_grammar(state: ServerState, body: SamplingFields) -> str | None:
    """The grammar for ``body.response_format``, compiled once here so a bad schema is a 400.

    Raises:
        APIError: 400 with ``param`` ``response_format`` (or ``response_format.json_schema``).
    """
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema = None
    elif fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            msg = "response_format json_schema needs json_schema.schema"
            raise invalid(msg, "response_format.json_schema")
        schema = fmt.json_schema.json_schema
    else:
        msg = f"response_format type {fmt.type!r} is not supported (text, json_object, json_schema)"
        raise invalid(msg, "response_format.type")
    try:
        grammar = json_grammar(schema)
    except RequestError as exc:
        raise invalid(f"response_format: {exc}", "response_format") from None
    return checked_grammar(state, grammar, "response_format")


def checked_grammar(state: ServerState, grammar: str, param: str) -> str:
    """``grammar``, once it compiled for this model's tokenizer (else a 400 naming ``param``)."""
    if state.tokenizer is None:
        raise invalid("structured output needs the model's tokenizer.json", param)
    engine = state.client.engine
    try:
        check_grammar(grammar, state.tokenizer, engine.config.vocab_size, list(engine.eos_token_ids))
    except RequestError as exc:
        raise invalid(f"{param}: {exc}", param) from None
    return grammar
