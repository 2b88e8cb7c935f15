"""Tool-call parsers: the family is chosen from the chat template; Qwen's ``<tool_call>`` JSON and
Mistral's ``[TOOL_CALLS]`` (a special token, found among the token ids) parse into OpenAI calls;
malformed calls stay content; streaming holds back text that may open a call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from moe_runtime.tokenizer import Tokenizer
from server.routes.tool_calls import tool_parser

BUNDLED = Path(__file__).resolve().parents[1] / "moe_runtime" / "assets" / "tiny-moe"


def _tokenizer(tmp_path: Path, special: list[str]) -> Tokenizer:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(BUNDLED / "tokenizer_config.json", folder)
    hf = HFTokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(t, special=True) for t in special])
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_qwen_calls_parse_and_stream_hold_back(tmp_path):
    tok = _tokenizer(tmp_path, [])
    parser = tool_parser(tok, "{% if tools %}<tool_call>{% endif %}")
    assert parser is not None and parser.name == "qwen" and parser.marker_id is None
    text = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    content, calls = parser.parse(text, [], tok)
    assert content == "Sure." and [c.function.name for c in calls] == ["a", "b"]
    assert _args(calls[0]) == {"x": 1} and _args(calls[1]) == {} and calls[0].id != calls[1].id
    assert parser.parse("no calls here", [], tok) == ("no calls here", [])
    broken = 'x <tool_call>{"name": oops}</tool_call>'
    assert parser.parse(broken, [], tok) == (broken, [])  # not JSON: the text stays content
    unclosed = '<tool_call>\n{"name": "a", "arguments": {"x": 2}}'
    assert _args(parser.parse(unclosed, [], tok)[1][0]) == {"x": 2}
    assert parser.content_end("Hello <tool", [], tok) == len("Hello ")  # may open a call: held
    assert parser.content_end("Hello <b>", [], tok) == len("Hello <b>")
    assert parser.content_end("Hi <tool_call>{", [], tok) == len("Hi ")


def test_mistral_calls_found_by_their_special_token(tmp_path):
    tok = _tokenizer(tmp_path, ["[TOOL_CALLS]"])
    parser = tool_parser(tok, "{{ '[TOOL_CALLS]' + tool_calls|tojson }}")
    assert (
        parser is not None and parser.name == "mistral" and parser.marker_id == tok.token_id("[TOOL_CALLS]")
    )
    body = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "t", "arguments": {}}]'
    ids = tok.encode("Checking.", add_special_tokens=False) + [parser.marker_id]
    ids += tok.encode(body, add_special_tokens=False)
    text = tok.decode(ids)  # what the detokeniser hands out: the special token is skipped
    assert "[TOOL_CALLS]" not in text
    content, calls = parser.parse(text, ids, tok)
    assert content == "Checking." and [c.function.name for c in calls] == ["get_weather", "t"]
    assert _args(calls[0]) == {"city": "Oslo"} and all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert parser.content_end(text, ids, tok) == len("Checking.")
    assert parser.forced_grammar([], parallel=True) is None  # no text grammar writes the special token


def test_mistral_marker_as_plain_text_and_no_parser_for_unknown_templates(tmp_path):
    tok = _tokenizer(tmp_path, [])
    parser = tool_parser(tok, "[TOOL_CALLS]")
    assert parser is not None and parser.marker_id is None  # not a single special token here
    content, calls = parser.parse('[TOOL_CALLS][{"name": "f", "arguments": {"a": [1]}}]', [], tok)
    assert content is None and _args(calls[0]) == {"a": [1]}
    assert tool_parser(tok, "{% for m in messages %}{{ m.content }}{% endfor %}") is None


def _matcher(grammar: str, tok: Tokenizer):
    from moe_runtime.engine.structured import GrammarMatcher

    return GrammarMatcher(grammar, tok, 8192, tok.eos_token_ids)


def _feed(matcher, tok: Tokenizer, text: str) -> bool:
    """True when ``matcher`` takes all of ``text``."""
    from moe_runtime.errors import RequestError

    try:
        for token in tok.encode(text, add_special_tokens=False):
            matcher.consume(token)
    except RequestError:
        return False
    return True


def test_forced_grammar_allows_a_bounded_number_of_calls_then_only_the_end():
    from server.routes.tool_calls import MAX_PARALLEL_CALLS

    tok = Tokenizer(BUNDLED)
    parser = tool_parser(tok, "<tool_call>")
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
    block = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    for parallel, most in ((False, 1), (True, MAX_PARALLEL_CALLS)):
        grammar = parser.forced_grammar([tool], parallel)
        for n in range(1, most + 1):
            m = _matcher(grammar, tok)
            assert _feed(m, tok, "\n".join([block] * n))
            if n < most:  # another call or the end
                assert not m.finished and bool(m.allowed()[tok.eos_token_ids[0]])
            else:  # nothing may follow: the engine ends the sequence here
                assert m.finished and not _feed(m, tok, "\n")
        assert not _feed(_matcher(grammar, tok), tok, "\n".join([block] * (most + 1)))
    m = _matcher(parser.forced_grammar([tool], True), tok)
    assert not _feed(m, tok, '<tool_call>\n{ "name"')  # no free whitespace in the JSON
    assert not _feed(_matcher(parser.forced_grammar([tool], True), tok), tok, "Sure. <tool_call>")


def test_json_grammar_layout_cannot_be_loosened_by_the_schema():
    from moe_runtime.engine.structured import json_grammar

    tok = Tokenizer(BUNDLED)
    loose = {"type": "object", "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": " *"}}
    assert not _feed(_matcher(json_grammar(loose), tok), tok, "{   ")
    m = _matcher(json_grammar(loose), tok)
    assert _feed(m, tok, '{"a": [1, 2], "b": {"c": null}}') and m.finished
