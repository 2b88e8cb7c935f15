"""Tool calls on the bundled tiny model (``moe_runtime/assets/tiny-moe``) through the official
``openai`` client on a real loopback server: its chat template renders tools in the Qwen/Hermes
format (as transformers renders it, and as the training recipe writes it), a forced
``tool_choice`` returns calls whose arguments validate against the tool's schema and then ends
with ``finish_reason="tool_calls"`` on every seed at temperature 1, a call goes back into the
conversation; replies without calls carry no ``tool_calls`` key; an unknown role and an empty
prompt are 400s that name their ``param``."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.tokenizer import Tokenizer
from server.routes.tool_calls import MAX_PARALLEL_CALLS
from server.settings import ServerSettings
from server.testing import serve_in_thread

MODEL = "tiny-moe"
SEEDS = range(20)
MAX_TOKENS = 400  # a call here is at most ~55 tokens; MAX_PARALLEL_CALLS of them stay far below this
# Every field is bounded (enum, integer range, maxLength, no extra properties), so a forced call
# always ends whatever the model samples.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Oslo", "Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "label": {"type": "string", "maxLength": 12},
            },
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, ALARM)}
ASK = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]


@pytest.fixture(scope="module")
def running():
    engine = LLMEngine.from_pretrained(default_model_dir(), RuntimeConfig(max_batch_size=64))
    with serve_in_thread(engine, ServerSettings(served_model_name=MODEL, max_wait_ms=20)) as running:
        yield running


@pytest.fixture(scope="module")
def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(running):
    with httpx.Client(base_url=running.base_url, timeout=60) as c:
        yield c


# ---------------------------------------------------------------------------- the template
def test_bundled_template_renders_tools_as_transformers_and_the_recipe_do():
    from transformers import AutoTokenizer

    from moeserve.train.tokenizer import CHAT_TEMPLATE, render_chat

    folder = default_model_dir()
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    system = {"role": "system", "content": "Be brief."}
    arguments = {"city": "Oslo", "days": 3}  # an object, as the server hands it to the template
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    calls = {"role": "assistant", "content": None, "tool_calls": [call, call]}
    said = {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "3 C, snow"}
    answer = {"role": "assistant", "content": "Snow."}
    for messages in (
        [*ASK],
        [system, *ASK],
        [*ASK, calls, result, result],
        [system, *ASK, said, result, answer],
    ):
        for tools in (None, [WEATHER, ALARM]):
            expected = theirs.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert ours.apply_chat_template(messages, tools=tools) == expected
    # without tools or tool calls the format is the one the model was trained on
    plain = [system, *ASK, answer, *ASK]
    assert (
        ours.apply_chat_template(plain)
        == render_chat(plain, add_generation_prompt=True)
        == (
            "<|system|>\nBe brief.\n<|user|>\nWhat is the weather in Oslo for the next 3 days?\n"
            "<|assistant|>\nSnow.<|endoftext|>\n<|user|>\nWhat is the weather in Oslo for the next 3 days?\n"
            "<|assistant|>\n"
        )
    )
    text = ours.apply_chat_template([system, *ASK, said, result], tools=[WEATHER])
    assert text.startswith("<|system|>\nBe brief.\n\n# Tools\n") and "\n<tools>\n" in text
    assert (
        '<|assistant|>\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "days": 3}}\n</tool_call><|endoftext|>\n'
        "<|user|>\n<tool_response>\n3 C, snow\n</tool_response>\n<|assistant|>\n"
    ) in text


# ---------------------------------------------------------------------------- forced calls
def _check_calls(choice, names: set[str], most: int) -> list:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert 1 <= len(calls) <= most, calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        parameters = TOOLS[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    assert len({c.id for c in calls}) == len(calls)
    return calls


def test_forced_tool_choice_ends_with_valid_calls_on_every_seed(running):
    named = {"type": "function", "function": {"name": "set_alarm"}}
    cases = [  # (tool_choice, parallel_tool_calls, allowed names, most calls)
        ("required", True, set(TOOLS), MAX_PARALLEL_CALLS),
        ("required", False, set(TOOLS), 1),
        (named, True, {"set_alarm"}, MAX_PARALLEL_CALLS),
    ]

    async def run_all() -> list:
        client = openai.AsyncOpenAI(
            base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        async with client:
            jobs = [
                client.chat.completions.create(
                    model=MODEL,
                    messages=ASK,
                    tools=[WEATHER, ALARM],
                    tool_choice=choice,
                    parallel_tool_calls=parallel,
                    max_tokens=MAX_TOKENS,
                    temperature=1.0,
                    seed=seed,
                )
                for choice, parallel, _, _ in cases
                for seed in SEEDS
            ]
            return await asyncio.gather(*jobs)

    replies = asyncio.run(run_all())  # all at once: one batch, one pass of decoding
    counts = []
    for i, r in enumerate(replies):
        _, _, names, most = cases[i // len(SEEDS)]
        (choice,) = r.choices
        counts.append(len(_check_calls(choice, names, most)))
        assert r.usage.completion_tokens < MAX_TOKENS
    assert max(counts[: len(SEEDS)]) > 1  # parallel calls do happen with parallel_tool_calls


def test_a_call_goes_back_into_the_conversation_and_streams(client, running):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
    )
    (call,) = _check_calls(r.choices[0], {"get_weather"}, 1)
    history = [
        *ASK,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3 C, snow"},
    ]
    again = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )
    # the server hands the template the arguments as an object, which it writes back as JSON
    (sent,) = history[1]["tool_calls"]
    parsed = {**sent, "function": {**sent["function"], "arguments": json.loads(call.function.arguments)}}
    tok = running.app.state.server.tokenizer
    messages = [*ASK, {**history[1], "tool_calls": [parsed]}, history[2]]
    rendered = tok.apply_chat_template(messages, tools=[WEATHER])
    assert again.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert f'"arguments": {call.function.arguments}}}\n</tool_call><|endoftext|>\n<|user|>\n' in rendered

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, ALARM],
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=3,
            stream=True,
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert deltas[-1].finish_reason == "tool_calls" and streamed
    assert [tc.index for tc in streamed] == list(range(len(streamed)))
    for tc in streamed:
        jsonschema.validate(
            json.loads(tc.function.arguments), TOOLS[tc.function.name]["function"]["parameters"]
        )


def test_replies_without_calls_have_no_tool_calls_key(client, http):
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}, {"tools": [WEATHER]}):
        body = {"messages": ASK, "max_tokens": 3, "temperature": 0, **extra}
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert "tool_calls" not in message and message["role"] == "assistant", message  # 3 tokens: no call
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        for event in events[:-1]:
            for choice in json.loads(event)["choices"]:
                assert "tool_calls" not in choice["delta"], event
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


def _bad(fn, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        fn()
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param, err
    return err


def test_unknown_role_and_empty_prompt_are_400_naming_the_field(client, http):
    wizard = [*ASK, {"role": "wizard", "content": "Cast a spell."}]
    err = _bad(lambda: client.chat.completions.create(model=MODEL, messages=wizard), "messages.1.role")
    assert "wizard" in err["message"] and err["code"] == "invalid_value"
    r = http.post("/tokenize", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    for prompt in ("", [[]], ["fine", ""]):
        _bad(lambda prompt=prompt: client.completions.create(model=MODEL, prompt=prompt), "prompt")
    _bad(lambda: client.chat.completions.create(model=MODEL, messages=[]), "messages")
    for role in ("system", "developer", "user", "assistant", "tool"):  # OpenAI's roles are accepted
        messages = [{"role": role, "content": "Hi"}, *ASK]
        assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).choices
