"""Every error case of the server with raw httpx: status, OpenAI error object, server still fine."""

from __future__ import annotations

import httpx
import pytest

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from server.settings import ServerSettings
from server.testing import serve_in_thread

MODEL = "tiny"
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def http(tiny_qwen3):
    engine = LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=4, max_model_len=64))
    settings = ServerSettings(served_model_name=MODEL, api_key=KEY, max_body_bytes=4096, max_wait_ms=0)
    with (
        serve_in_thread(engine, settings) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as c,
    ):
        c.running = running
        yield c


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code
    if param != "<any>":
        assert err["param"] == param
    return err


def post(http: httpx.Client, body: dict, path: str = "/v1/completions", **kw) -> httpx.Response:
    return http.post(path, json=body, headers=kw.pop("headers", AUTH), **kw)


def test_401_without_or_with_wrong_key(http):
    err = assert_error(post(http, {"prompt": "x"}, headers={}), 401, "invalid_api_key")
    assert err["type"] == "authentication_error"
    assert_error(
        post(http, {"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key"
    )
    assert_error(http.get("/v1/models"), 401, "invalid_api_key")
    assert_error(post(http, {"prompt": 5}, headers={}), 401, "invalid_api_key")  # before schema checks
    assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    assert http.get("/health").status_code == 200  # probes need no key
    assert http.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 300}, "n"),  # more than --max-batch-size + --max-queue
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}},
            },
            "response_format",
        ),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["ok", ""]}, "prompt"),
        ({"prompt": [5] * 64}, "prompt"),  # the prompt fills the whole 64-token context
        ({"prompt": [1, 2, 10_000]}, "prompt"),  # token id out of range
    ],
)
def test_400_invalid_values(http, body, param):
    err = assert_error(post(http, body), 400, "invalid_value", param)
    assert err["type"] == "invalid_request_error"


def test_400_chat_values(http):
    msgs = [{"role": "user", "content": "hi"}]
    path = "/v1/chat/completions"
    assert_error(
        post(http, {"messages": msgs, "top_logprobs": 2}, path), 400, "invalid_value", "top_logprobs"
    )
    assert_error(post(http, {"messages": []}, path), 400, "invalid_value", "messages")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(http, {"messages": image}, path), 400, "invalid_value", "messages.0")
    wizard = [*msgs, {"role": "wizard", "content": "abracadabra"}]
    err = assert_error(post(http, {"messages": wizard}, path), 400, "invalid_value", "messages.1.role")
    assert "wizard" in err["message"]
    empty = {"messages": msgs, "chat_template": "{% if false %}x{% endif %}"}  # renders nothing
    assert_error(post(http, empty, path), 400, "invalid_value", "messages")
    long = [{"role": "user", "content": "word " * 100}]  # over the 64-token context
    assert_error(post(http, {"messages": long}, path), 400, "invalid_value", "messages")
    assert post(http, {"messages": msgs, "max_tokens": 1}, path).status_code == 200  # still serving


def test_prompt_too_long_streaming_is_a_plain_400(http):
    r = post(http, {"prompt": [5] * 80, "stream": True})
    err = assert_error(r, 400, "invalid_value", "prompt")
    assert "64" in err["message"]


def test_404_unknown_model_and_route(http):
    assert_error(post(http, {"prompt": "x", "model": "gpt-4"}), 404, "model_not_found", "model")
    chat = {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}
    assert_error(post(http, chat, "/v1/chat/completions"), 404, "model_not_found")
    assert_error(http.get("/v1/nothing", headers=AUTH), 404, "not_found")


def test_413_body_too_large(http):
    big = {"prompt": "x" * 5000}
    assert_error(post(http, big), 413, "request_too_large")

    def chunked():  # no Content-Length: counted while it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = http.post("/v1/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 413, "request_too_large")


def test_schema_errors_are_400_with_param(http):
    assert_error(post(http, {"max_tokens": 3}), 400, "invalid_schema", "prompt")
    err = assert_error(post(http, {"prompt": 5}), 400, "invalid_schema", "prompt")
    assert "allowed forms" in err["message"]
    assert_error(post(http, {"prompt": "x", "n": "many"}), 400, "invalid_schema", "n")
    r = http.post(
        "/v1/completions", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_error(r, 400, "invalid_schema", "body")
    assert_error(post(http, ["not", "an", "object"]), 400, "invalid_schema", "body")
    assert_error(post(http, {"messages": "hi"}, "/v1/chat/completions"), 400, "invalid_schema", "messages")


def test_null_fields_mean_their_default(http):
    nulls = dict.fromkeys(["n", "stream", "echo", "logprobs", "temperature", "stop", "seed", "user"])
    r = post(http, {"prompt": "x", "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_a_failing_request_never_takes_the_server_down(http):
    state = http.running.app.state.server
    tokenizer = state.tokenizer

    class Broken:
        def encode(self, *a, **k):
            raise RuntimeError("tokenizer exploded")

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    state.tokenizer = Broken()
    try:
        err = assert_error(post(http, {"prompt": "x"}), 500, "server_error")
        assert err["type"] == "server_error" and "exploded" not in err["message"]
    finally:
        state.tokenizer = tokenizer
    assert http.get("/health").status_code == 200
    r = post(http, {"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.running.client.engine.num_running == 0


def test_a_sampling_value_the_limits_miss_is_still_a_400_naming_the_field():
    from server.errors import APIError
    from server.protocol import CompletionRequest
    from server.routes.common import sampling_params

    for field, value in (("temperature", -1.0), ("top_p", 0.0), ("min_p", 2.0)):
        with pytest.raises(APIError) as info:
            sampling_params(CompletionRequest(prompt="x", **{field: value}), 4, None, 0)
        assert info.value.status == 400 and info.value.param == field
