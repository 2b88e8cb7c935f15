"""Hostile requests: no 5xx, no engine death, no hang; one request's failure is its own.

Every case runs against the in-process server on the tiny checkpoint. After the module the engine
still answers, ``/health`` is 200 and a fixed greedy completion is unchanged.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine import outputs as outputs_module
from moe_runtime.engine import sampler as sampler_module
from moe_runtime.engine.engine import LLMEngine
from moeserve.cli import main
from server.app import create_app
from server.runner import ENGINE_DEAD_EXIT, make_server
from server.settings import ServerSettings
from server.testing import serve_in_thread

GREEDY = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(tiny_qwen3):
    engine = LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=10, max_model_len=64))
    settings = ServerSettings(served_model_name="tiny", max_wait_ms=0, max_queue=16)
    with (
        serve_in_thread(engine, settings) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as c,
    ):
        c.running = running
        c.reference = c.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        yield c
        # after everything in this module: alive, healthy, and the same greedy answer
        assert running.client.alive and c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == c.reference
        assert running.client.engine.num_running == 0 and running.client.num_open == 0


def post(http: httpx.Client, body: dict | str, path: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, str):  # raw JSON: NaN, 1e400, escapes
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


def greedy_text(http: httpx.Client, body: dict, path: str) -> str:
    r = post(http, body, path)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


# ------------------------------------------------------------------ sampling values
TINY = ["1e-40", "1e-39", "1e-300", "5e-324", "0.000001"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_greedy(http, path, temperature):
    body = GREEDY if path == "/v1/completions" else CHAT
    raw = json.dumps({**body, "temperature": 0}).replace('"temperature": 0', f'"temperature": {temperature}')
    assert greedy_text(http, raw, path) == greedy_text(http, {**body, "temperature": 0}, path)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tiny_top_p_keeps_the_top_token(http, path):
    body = GREEDY if path == "/v1/completions" else CHAT
    raw = json.dumps({**body, "temperature": 1, "seed": 5}).replace('"seed": 5', '"seed": 5, "top_p": 1e-300')
    assert greedy_text(http, raw, path) == greedy_text(http, {**body, "temperature": 0}, path)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("temperature", "1e400"),
        ("temperature", "-1e-300"),
        ("temperature", "2.5"),
        ("top_p", "NaN"),
        ("top_p", "0"),
        ("top_p", "-Infinity"),
        ("top_p", "1.0000001"),
        ("top_k", "-2"),
        ("seed", "18446744073709551616"),
        ("seed", "1e30"),
        ("seed", "-9223372036854775809"),
        ("n", "0"),
        ("n", "1000000000"),
    ],
)
def test_bad_values_are_400_naming_the_field(http, path, field, value):
    body = GREEDY if path == "/v1/completions" else CHAT
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'
    r = post(http, raw, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err


# ------------------------------------------------------------------ sizes, ids, text
def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


SIZE_CASES = [
    ({**GREEDY, "n": 1_000_000_000}, "/v1/completions", "n"),
    ({**CHAT, "n": 1_000_000_000}, "/v1/chat/completions", "n"),
    ({**GREEDY, "prompt": ["a"] * 20_000}, "/v1/completions", "n"),  # prompts x n, before tokenizing
    ({**GREEDY, "stop": [f"s{i}" for i in range(50_000)]}, "/v1/completions", "stop"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "/v1/chat/completions", "stop"),
    ({**GREEDY, "stop": "x" * 257}, "/v1/completions", "stop"),
    ({**GREEDY, "stop_token_ids": list(range(65))}, "/v1/completions", "stop_token_ids"),
    ({**GREEDY, "stop_token_ids": [-1]}, "/v1/completions", "stop_token_ids"),
    ({**GREEDY, "prompt": [-1]}, "/v1/completions", "prompt"),
    ({**GREEDY, "prompt": [1_000_000_000_000]}, "/v1/completions", "prompt"),
    ({**GREEDY, "prompt": [[1, 2], [3, 10**30]]}, "/v1/completions", "prompt"),
    ({**GREEDY, "prompt": list(range(100_000))}, "/v1/completions", "prompt"),
    ({**GREEDY, "logprobs": 21}, "/v1/completions", "logprobs"),
    ({**GREEDY, "logprobs": -1}, "/v1/completions", "logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 50}, "/v1/chat/completions", "top_logprobs"),
    ({**GREEDY, "max_tokens": 0}, "/v1/completions", "max_tokens"),
]


@pytest.mark.parametrize(("body", "path", "param"), SIZE_CASES)
def test_limits_are_400_before_any_work(http, body, path, param):
    before = _rss_bytes()
    t0 = time.perf_counter()
    r = post(http, body, path)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert elapsed < 1.0, f"{param} limit took {elapsed * 1000:.0f} ms"  # goal < 100 ms; loose bound
    assert _rss_bytes() - before < 64 << 20  # no allocation per sequence or stop string


@pytest.mark.parametrize(
    ("raw", "path", "param"),
    [
        ('{"prompt": "a\\ud800b", "max_tokens": 2}', "/v1/completions", "prompt"),
        ('{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "/v1/completions", "prompt"),
        ('{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}', "/v1/completions", "stop"),
        (
            '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            "/v1/chat/completions",
            "messages.0.content",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
            "/v1/chat/completions",
            "messages.0.content",
        ),
        ('{"messages": [{"role": "\\ud800", "content": "x"}]}', "/v1/chat/completions", "messages.0.role"),
    ],
)
def test_lone_surrogates_are_400(http, raw, path, param):
    r = post(http, raw, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------ one request fails alone
GOOD = [
    {"prompt": [7 + i, 40 + 3 * i, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for i in range(8)
]
BAD_PROMPT = [5, 5, 5, 5]


def _stream_text(http: httpx.Client, body: dict) -> tuple[str, list[dict]]:
    text, events = "", []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    payloads = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(p["choices"][0]["text"] for p in payloads if p.get("choices"))
    assert events[-1] == "[DONE]"
    return text, payloads


@pytest.mark.parametrize("fault", ["detokenizer", "sampler"])
def test_one_failing_request_leaves_eight_concurrent_streams_intact(http, monkeypatch, fault):
    alone = [_stream_text(http, g)[0] for g in GOOD]
    assert len(set(alone)) > 1  # the prompts really differ

    if fault == "detokenizer":
        real = outputs_module.update_text

        def update_text(seq, tokenizer):
            if seq.prompt_token_ids == BAD_PROMPT and len(seq.output_token_ids) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real(seq, tokenizer)

        monkeypatch.setattr(outputs_module, "update_text", update_text)
        bad = {"prompt": BAD_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    else:
        real = sampler_module._draw

        def draw(row, p, generator):
            if p.seed == 666:
                raise RuntimeError("injected sampler fault")
            return real(row, p, generator)

        monkeypatch.setattr(sampler_module, "_draw", draw)
        bad = {"prompt": BAD_PROMPT, "max_tokens": 8, "temperature": 0.7, "seed": 666}

    def bad_stream():
        return _stream_text(http, bad)[1]

    def bad_whole():
        return http.post("/v1/completions", json=bad)

    with ThreadPoolExecutor(10) as pool:
        goods = [pool.submit(_stream_text, http, g) for g in GOOD]
        bad_s, bad_w = pool.submit(bad_stream), pool.submit(bad_whole)
        together = [f.result(timeout=60)[0] for f in goods]
        payloads, whole = bad_s.result(timeout=60), bad_w.result(timeout=60)
    assert together == alone
    assert payloads[-1]["error"]["type"] == "server_error"  # then [DONE] (checked in _stream_text)
    assert "injected" not in payloads[-1]["error"]["message"]
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "server_error"
    assert http.running.client.alive and http.get("/health").status_code == 200
    assert http.running.client.engine.stats.requests_finished.get("error", 0) >= 2


# ------------------------------------------------------------------ engine death ends the process
def test_engine_death_exits_the_process_non_zero(tiny_qwen3, monkeypatch):
    engine = LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=2, max_model_len=32))

    def boom() -> list:
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(engine, "step", boom)
    server = make_server(create_app(engine, ServerSettings(max_wait_ms=0)), log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    answers: list[httpx.Response] = []

    def client() -> None:
        while not server.started:
            time.sleep(0.02)
        answers.append(httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with pytest.raises(SystemExit) as exited:
        server.run(sockets=[sock])  # the main thread, as under ``moeserve serve``
    thread.join(10)
    sock.close()
    assert exited.value.code == ENGINE_DEAD_EXIT != 0
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "engine_dead"


# ------------------------------------------------------------------ the generate CLI
@pytest.mark.parametrize(
    ("flag", "value"),
    [("--temperature", "nan"), ("--temperature", "-1"), ("--top-p", "0"), ("--seed", str(2**64))],
)
def test_generate_refuses_bad_sampling_flags(capsys, tiny_qwen3, flag, value):
    rc = main(["generate", "--model", str(tiny_qwen3), "--prompt-ids", "1,2,3", flag, value])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and flag in err and "Traceback" not in err, err


def test_generate_tiny_temperature_and_top_p_are_greedy(capsys, tiny_qwen3):
    base = ["generate", "--model", str(tiny_qwen3), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]

    def ids(*extra: str) -> list[int]:
        assert main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    greedy = ids()
    assert ids("--temperature", "1e-40") == greedy
    assert ids("--temperature", "1", "--top-p", "1e-300", "--seed", "3") == greedy


def test_a_failing_choice_aborts_its_siblings(http, monkeypatch):
    real = sampler_module._draw

    def draw(row, p, generator):
        if p.seed == 666:  # choice 0 of a request seeded 666; choice 1 is seeded 667
            raise RuntimeError("injected sampler fault")
        return real(row, p, generator)

    monkeypatch.setattr(sampler_module, "_draw", draw)
    stats = http.running.client.engine.stats
    aborted = stats.requests_finished.get("abort", 0)
    body = {
        "prompt": BAD_PROMPT,
        "n": 2,
        "seed": 666,
        "temperature": 0.7,
        "max_tokens": 50,
        "ignore_eos": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    deadline = time.monotonic() + 10
    while stats.requests_finished.get("abort", 0) == aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats.requests_finished.get("abort", 0) == aborted + 1  # choice 1 stopped, not run to 50
