"""Every accepted field through the official ``openai`` client on a real loopback server: tools
with a Qwen3-style template (stubbed model output), chat template kwargs, penalties, ``min_p``,
``logit_bias``, ``response_format`` output that validates, 400s with ``param``, ``/tokenize``,
``/detokenize``, ``/version``, ``/v1/models/{id}`` and CORS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from clients.sizing import ServerTokenizer
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from server.settings import ServerSettings
from server.testing import serve_in_thread

MODEL = "tiny-chat"
ORIGIN = "https://app.example"
TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of ``src`` with ``template``; 1024 positions (the byte-level test tokenizer spends
    many tokens on a template's tool block)."""
    shutil.copytree(src, dst)
    model_config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 1024}))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / template).read_text()
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


class Script:
    """Stubs the model's output: while ``text`` is set, each sampled row's logits put all mass
    on the next token of ``text`` (then EOS), so a request answers exactly ``text``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.ids = engine, None
        self.forward = engine.model.forward
        engine.model.forward = self

    def __call__(self, ids: torch.Tensor, step) -> torch.Tensor:
        logits = self.forward(ids, step)
        if self.ids is None:
            return logits
        (seq,) = self.engine._seqs.values()  # one request at a time in these tests
        n = len(seq.output_token_ids)
        token = self.ids[n] if n < len(self.ids) else self.engine.eos_token_ids[0]
        scripted = torch.full_like(logits, -30.0)
        scripted[:, token] = 30.0
        return scripted

    def say(self, text: str | None) -> None:
        self.ids = None if text is None else self.engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def served(tiny_qwen3, tmp_path_factory):
    folder = _with_template(tiny_qwen3, tmp_path_factory.mktemp("qwen3chat") / "ckpt", "qwen3_style.jinja")
    engine = LLMEngine.from_pretrained(folder, RuntimeConfig(max_batch_size=4, max_model_len=1024))
    script = Script(engine)
    settings = ServerSettings(served_model_name=MODEL, max_wait_ms=0, allowed_origins=(ORIGIN,))
    with serve_in_thread(engine, settings) as running:
        yield running, script


@pytest.fixture(scope="module")
def running(served):
    return served[0]


@pytest.fixture(scope="module")
def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def script(served):
    yield served[1]
    served[1].say(None)


def _bad(fn, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        fn()
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param, err
    return err


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_round_trip(client, running, script):
    script.say("Let me look.\n" + CALL_TEXT)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the call and its result go back; the template sees whole messages (arguments as an object)
    script.say("It is sunny in Paris.")
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "22 C, sun"},
    ]
    again = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=300, temperature=0
    )
    assert (
        again.choices[0].message.content == "It is sunny in Paris."
        and not again.choices[0].message.tool_calls
    )
    tok = running.app.state.server.tokenizer
    rendered = tok.apply_chat_template(
        [
            *ASK,
            {
                **history[1],
                "tool_calls": [
                    {**call.model_dump(), "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            history[2],
        ],
        tools=[WEATHER],
    )
    assert '"arguments": {"city": "Paris"}' in rendered and "<tool_response>\n22 C, sun" in rendered
    assert again.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_tool_call_streams_as_a_tool_calls_delta(client, script):
    script.say(CALL_TEXT)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0, stream=True
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert content == "" and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_renders_no_tools_and_parses_nothing(client, script):
    script.say(CALL_TEXT)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=300, temperature=0
    )
    assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1)
    assert r.usage.prompt_tokens < with_tools.usage.prompt_tokens


UNITS = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}, "round": {"type": "boolean"}},
            "required": ["unit", "round"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_forced_tool_choice_is_enforced_by_a_grammar(client, choice):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, UNITS],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=1.0,
        seed=5,
    )
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "set_unit": UNITS}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "set_unit"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_unsupported_tool_options_are_400(client, tiny_qwen3, tmp_path):
    for choice in ("any", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}):
        _bad(
            lambda choice=choice: client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice
            ),
            "tool_choice",
        )
    _bad(
        lambda: client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required"),
        "tool_choice",
    )
    _bad(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
        "response_format",
    )
    folder = _with_template(tiny_qwen3, tmp_path / "mixtral", "mixtral_style.jinja")  # no call format
    engine = LLMEngine.from_pretrained(folder, RuntimeConfig(max_batch_size=2, max_model_len=1024))
    with serve_in_thread(engine, ServerSettings(served_model_name=MODEL, max_wait_ms=0)) as other:
        mixtral = openai.OpenAI(base_url=other.base_url + "/v1", api_key="x", max_retries=0)
        _bad(lambda: mixtral.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]), "tools")


def test_chat_template_kwargs_and_continue_final_message(client, running):
    _bad(
        lambda: client.chat.completions.create(
            model=MODEL, messages=ASK, extra_body={"chat_template": "nope"}
        ),
        "chat_template",
    )
    tok = running.app.state.server.tokenizer
    for kwargs in ({"enable_thinking": False}, {}):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
        )
        want = tok.apply_chat_template(ASK, chat_template_kwargs=kwargs)
        assert r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))
    partial = [*ASK, {"role": "assistant", "content": "It is"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=partial,
        max_tokens=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    want = tok.apply_chat_template(partial, add_generation_prompt=False, continue_final_message=True)
    assert want.endswith("It is") and r.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))
    _bad(
        lambda: client.chat.completions.create(
            model=MODEL, messages=partial, extra_body={"continue_final_message": True}
        ),
        "continue_final_message",
    )
    _bad(
        lambda: client.chat.completions.create(
            model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {"messages": []}}
        ),
        "chat_template_kwargs",
    )


def test_logit_bias_forces_a_token_and_penalties_change_sampling(client, running):
    tok = running.app.state.server.tokenizer
    forced = tok.encode(" fox", add_special_tokens=False)[-1]
    r = client.completions.create(
        model=MODEL, prompt="The", max_tokens=4, temperature=1.0, seed=3, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == tok.decode([forced] * 4)
    kw = dict(model=MODEL, prompt="The quick", max_tokens=12, temperature=0, logprobs=0)
    greedy = client.completions.create(**kw)
    plain = greedy.choices[0].logprobs.tokens
    banned = client.completions.create(
        **kw, logit_bias={str(tok.token_id(plain[0]) or tok.encode(plain[0])[0]): -100}
    )
    assert banned.choices[0].logprobs.tokens[0] != plain[0]
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself when greedy ...
    penalized = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0)
    tokens = penalized.choices[0].logprobs.tokens
    assert len(tokens) - len(set(tokens)) < len(plain) - len(set(plain))  # ... and less so when penalized
    rep = client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=12, temperature=0, extra_body={"repetition_penalty": 2.0}
    )
    assert rep.choices[0].finish_reason in ("stop", "length")
    same = client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    assert same.choices[0].text == greedy.choices[0].text  # neutral values change nothing


def test_min_p_one_samples_the_greedy_answer(client):
    greedy = client.completions.create(model=MODEL, prompt="Question: What", max_tokens=8, temperature=0)
    sampled = client.completions.create(
        model=MODEL, prompt="Question: What", max_tokens=8, temperature=1.5, n=3, extra_body={"min_p": 1.0}
    )
    assert {c.text for c in sampled.choices} == {greedy.choices[0].text}


SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "boolean"},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "null"}, {"enum": [1, 2, 3]}]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"}, "ok": {"const": True}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "boolean"}, {"enum": ["x"]}],
                "items": False,
                "minItems": 2,
            }
        },
        "required": ["pair"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"r": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["r"],
        "additionalProperties": False,
    },
    *[
        {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
        for props in (
            {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}},
            {
                "level": {"enum": ["low", "mid", "high"]},
                "count": {"type": "integer", "minimum": 0, "maximum": 3},
            },
            {"code": {"type": "string", "pattern": "^[A-F0-9]{4}$"}},
            {
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 4,
                }
            },
            {"flag": {"type": ["boolean", "null"]}},
            {
                "nested": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {"k": {"enum": ["a", "b"]}},
                        "required": ["k"],
                        "additionalProperties": False,
                    },
                }
            },
            {
                "word": {"type": "string", "minLength": 1, "maxLength": 4},
                "n": {"type": "integer", "maximum": 5, "minimum": 5},
            },
            {"choice": {"oneOf": [{"const": "yes"}, {"const": "no"}]}},
            {
                "matrix": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}},
                }
            },
            {"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])$"}, "v": {"type": "null"}},
        )
    ],
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_output_validates_at_temperature_1(client, index):
    schema = SCHEMAS[index]
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=60,
        temperature=1.0,
        n=2,
        seed=index,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}},
    )
    for choice in r.choices:  # 20 schemas x 2 choices = 40 sampled outputs
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_output_parses(client):
    r = client.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=60,
        temperature=0.7,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: still a valid JSON prefix that opens an object
        assert r.choices[0].text.startswith("{")


def test_type_errors_are_400_with_param(client):
    _bad(
        lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"temperature": "hot"}),
        "temperature",
    )
    _bad(
        lambda: client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"tools": "all"}),
        "tools",
    )
    _bad(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": 3}]), "messages.0.role")


def test_tokenize_detokenize_version_model_and_cors(running):
    tok = running.app.state.server.tokenizer
    with httpx.Client(base_url=running.base_url, timeout=30) as http:
        text = "The quick brown fox"
        t = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
        assert t["tokens"] == tok.encode(text, add_special_tokens=False) and t["count"] == len(t["tokens"])
        assert t["max_model_len"] == 1024
        assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": text}
        assert ServerTokenizer(http, running.base_url, MODEL).count(text) == t["count"]  # the replay client
        chat = http.post("/tokenize", json={"messages": ASK}).json()
        assert chat["tokens"] == tok.encode(tok.apply_chat_template(ASK), add_special_tokens=False)
        bad = http.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.get("/version").json()["version"]
        card = http.get(f"/v1/models/{MODEL}").json()
        assert card["id"] == MODEL and card["max_model_len"] == 1024
        missing = http.get("/v1/models/other")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        pre = http.options(
            "/v1/chat/completions",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        got = http.get("/v1/models", headers={"Origin": ORIGIN})
        assert got.headers["access-control-allow-origin"] == ORIGIN
        other = http.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_echo_with_logprobs_returns_prompt_logprobs(client, running):
    tok = running.app.state.server.tokenizer
    prompt = "The quick brown fox"
    n_prompt = len(tok.encode(prompt))
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert (
        "".join(lp.tokens[:n_prompt]) == prompt
        and lp.token_logprobs[0] is None
        and lp.top_logprobs[0] is None
    )
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
