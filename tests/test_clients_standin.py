"""Replay client against a tiny stand-in OpenAI server on loopback (forces 4xx / 5xx / timing).

The stand-in streams ``max_tokens`` short text chunks, ``tokens_delay_s`` apart, and counts what
it served in Prometheus counters named like moeserve's, so the report's server section is exercised.
Its tokenizer is one token per :data:`CHARS_PER_TOKEN` characters (plus BOS), which it serves on
``/tokenize`` (vLLM's API) unless ``tokenize`` is off, and it refuses a prompt + ``max_tokens``
over its 512-token context with 400, as moeserve does. Its ``/health`` answers ``health_status``
(503 until ``unhealthy_until``), and ``/v1/models`` lists ``listed``, so tests can start it late,
keep it unready, or make it list no model; every request's ``model`` field is recorded.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from clients.errors import ClientError
from clients.options import ReplayConfig
from clients.ready import ServerUnavailable
from clients.replay import replay
from moeserve.cli import main

CHARS_PER_TOKEN = 2
CONTEXT = 512


def standin_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


ROWS = [  # 12 arrivals over 1.1 s of trace time, irregular gaps
    "2023-11-16 18:15:46.0000000,40,3",
    "2023-11-16 18:15:46.0500000,20,2",
    "2023-11-16 18:15:46.0600000,30,4",
    "2023-11-16 18:15:46.3000000,10,1",
    "2023-11-16 18:15:46.3100000,50,5",
    "2023-11-16 18:15:46.5000000,60,2",
    "2023-11-16 18:15:46.5200000,15,3",
    "2023-11-16 18:15:46.8000000,25,2",
    "2023-11-16 18:15:46.8010000,35,1",
    "2023-11-16 18:15:47.0000000,45,4",
    "2023-11-16 18:15:47.0500000,55,2",
    "2023-11-16 18:15:47.1000000,65,3",
]


class StandIn:
    """State of the stand-in server: ``mode`` is ``ok``, ``400`` or ``500``."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.received: list[float] = []
        self.success = 0
        self.gen_tokens = 0
        self.lookups = 0
        self.hits = 0
        self.token_delay_s = 0.002
        self.tokenize = True
        self.health_status = 200
        self.unhealthy_until = 0.0  # perf_counter time before which /health answers 503
        self.health_polls = 0
        self.listed = ["standin"]
        self.models_status = 200
        self.models_seen: list[str | None] = []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            self.health_polls += 1
            if time.perf_counter() < self.unhealthy_until:
                return JSONResponse({"status": "loading"}, 503)
            return JSONResponse({}, self.health_status)

        @app.get("/v1/models")
        async def models():
            if self.models_status != 200:
                return JSONResponse({"error": {"message": "models broke"}}, self.models_status)
            data = [{"id": name, "object": "model", "max_model_len": CONTEXT} for name in self.listed]
            return {"object": "list", "data": data}

        @app.post("/tokenize")
        async def tokenize(request: Request):
            if not self.tokenize:
                return JSONResponse({"detail": "Not Found"}, 404)
            body = await request.json()
            n = standin_tokens(body["prompt"]) + (1 if body.get("add_special_tokens", True) else 0)
            return {"count": n, "max_model_len": CONTEXT, "tokens": list(range(n))}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            text = (
                "# TYPE moeserve_expert_lookups_total counter\n"
                f'moeserve_expert_lookups_total{{layer="0"}} {self.lookups}\n'
                "# TYPE moeserve_expert_hits_total counter\n"
                f'moeserve_expert_hits_total{{layer="0"}} {self.hits}\n'
                "# TYPE moeserve_request_success_total counter\n"
                f'moeserve_request_success_total{{finished_reason="length"}} {self.success}\n'
                "# TYPE moeserve_generation_tokens_total counter\n"
                f"moeserve_generation_tokens_total {self.gen_tokens}\n"
            )
            return PlainTextResponse(text)

        @app.post("/v1/completions")
        async def completions(request: Request):
            self.received.append(time.perf_counter())
            body = await request.json()
            self.models_seen.append(body.get("model"))
            if self.mode == "400":
                return JSONResponse({"error": {"message": "prompt too long", "type": "invalid"}}, 400)
            if self.mode == "500":
                return JSONResponse({"error": {"message": "engine died", "type": "internal"}}, 500)
            n = int(body["max_tokens"])
            prompt_tokens = standin_tokens(body["prompt"]) + 1
            if prompt_tokens + n > CONTEXT:
                msg = f"the prompt has {prompt_tokens} tokens; with max_tokens {n} it exceeds {CONTEXT}"
                return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, 400)
            if not body.get("stream"):  # the replay client's calibration probe
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 1,
                    "total_tokens": prompt_tokens + 1,
                }
                return {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "usage": usage}

            async def gen():
                for i in range(n):
                    await asyncio.sleep(self.token_delay_s)
                    # raw U+2028 / U+0085 in JSON text are legal and must not split an SSE line
                    text = "x\u2028\x85é"
                    choice = {"index": 0, "text": text, "finish_reason": "length" if i == n - 1 else None}
                    yield f"data: {json.dumps({'choices': [choice]}, ensure_ascii=False)}\r\n\r\n"
                self.success += 1
                self.gen_tokens += n
                self.lookups += 4 * n
                self.hits += 3 * n
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                    "expert_stats": {"buffer_hits": 3 * n, "buffer_misses": n, "blocking_ms": 0.5},
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(state: StandIn, delay_s: float = 0.0) -> Iterator[str]:
    """Run ``state``'s app on a free loopback port, starting ``delay_s`` seconds from now; yields
    its URL at once (with a delay, before anything listens there)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(state.app(), host="127.0.0.1", port=port, log_level="error"))

    def run() -> None:
        time.sleep(delay_s)
        server.run()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=delay_s + 5)


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[StandIn, str]]:
    state = StandIn()
    with serving(state) as url:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        yield state, url


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(ROWS) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"dataset": d, "task": t, "prompt": f"{d} {t} question {i}?"})
            for i, (d, t) in enumerate([("a", "x"), ("a", "y"), ("b", "z")] * 3)
        )
        + "\n"
    )
    return trace, prompts


def test_arrivals_follow_trace_and_counts_match(standin, files, tmp_path: Path) -> None:
    state, url = standin
    state.mode = "ok"
    trace, prompts = files
    before = (state.success, state.gen_tokens)
    cfg = ReplayConfig(
        url=url,
        prompts=prompts,
        trace=trace,
        speedup=2.0,
        max_tokens_cap=4,
        out=tmp_path / "run",
        progress=False,
        slo_tpot_ms=1000.0,
    )
    s = replay(cfg)
    recs = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert s.requests == len(ROWS) == s.succeeded
    # schedule = trace offsets / speedup; actual sends within a tolerance of it
    expected = [0.0, 0.025, 0.03, 0.15, 0.155, 0.25, 0.26, 0.4, 0.4005, 0.5, 0.525, 0.55]
    assert [r["scheduled_s"] for r in recs] == pytest.approx(expected, abs=1e-6)
    assert all(abs(r["sent_s"] - r["scheduled_s"]) < 0.1 for r in recs)  # 2 busy cores: loose
    rel = [t - state.received[-len(ROWS)] for t in state.received[-len(ROWS) :]]
    assert rel == pytest.approx(expected, abs=0.1)
    # max_tokens = min(GeneratedTokens, cap); tokens counted match the server's counters
    assert [r["max_tokens"] for r in recs] == [3, 2, 4, 1, 4, 2, 3, 2, 1, 4, 2, 3]
    assert s.output_tokens == sum(r["max_tokens"] for r in recs)
    assert s.server is not None
    assert s.server.requests_success == state.success - before[0] == s.succeeded
    assert s.server.generation_tokens == state.gen_tokens - before[1] == s.output_tokens
    assert s.server.hit_rate == pytest.approx(0.75)
    assert s.goodput_rps is not None and s.goodput_rps > 0
    assert s.ttft.count == len(ROWS) and s.itl.count == sum(r["max_tokens"] - 1 for r in recs)
    assert s.client_expert_stats["buffer_hits"] == 3 * s.output_tokens
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "summary.txt").exists()


@pytest.mark.parametrize("mode", ["400", "500"])
def test_http_errors_are_reported(standin, files, tmp_path: Path, mode: str) -> None:
    state, url = standin
    state.mode = mode
    trace, prompts = files
    cfg = ReplayConfig(
        url=url,
        prompts=prompts,
        trace=trace,
        speedup=10.0,
        max_requests=4,
        out=tmp_path / "run",
        progress=False,
    )
    try:
        s = replay(cfg)
    finally:
        state.mode = "ok"
    assert s.requests == 4 and s.succeeded == 0
    assert s.errors == {f"http_error {mode}": 4}
    rec = json.loads((tmp_path / "run" / "requests.jsonl").read_text().splitlines()[0])
    assert rec["http_status"] == int(mode)
    assert ("prompt too long" if mode == "400" else "engine died") in rec["error"]


def test_unreachable_server_fails_with_one_line_after_wait(files, tmp_path: Path) -> None:
    trace, prompts = files
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ReplayConfig(
        url=url,
        prompts=prompts,
        trace=trace,
        speedup=10.0,
        max_requests=3,
        out=tmp_path / "run",
        progress=False,
        wait_s=1.0,
    )
    start = time.monotonic()
    with pytest.raises(ServerUnavailable) as err:
        replay(cfg)
    waited = time.monotonic() - start
    assert 0.9 <= waited < 5.0
    msg = str(err.value)
    assert "\n" not in msg and f"GET {url}/health" in msg and "within 1 s" in msg and "cannot connect" in msg
    assert "poll(s), every 0.25 s" in msg and "--wait-s" in msg
    assert not (tmp_path / "run").exists()  # no run, no files


def test_cli_unreachable_server_exits_nonzero_with_one_line(files, tmp_path: Path, capsys) -> None:
    trace, prompts = files
    url = f"http://127.0.0.1:{free_port()}"
    for cmd in (["replay", "--speedup", "10"], ["bench", "sweep", "--rates", "1,2"]):
        rc = main(
            [
                *cmd,
                "--url",
                url,
                "--trace",
                str(trace),
                "--prompts",
                str(prompts),
                "--wait-s",
                "0.5",
                "--out",
                str(tmp_path / cmd[-1]),
                "--no-progress",
            ]
        )
        lines = capsys.readouterr().err.strip().splitlines()
        assert rc == 2
        # the sweep rules off the rate first; the error itself is one line, the last
        assert len(lines) == (1 if cmd[0] == "replay" else 2)
        assert lines[-1].startswith(f"moeserve: error: no server ready at {url}: ")
        assert "within 0.5 s" in lines[-1]


def test_waits_for_a_server_that_starts_late(files, tmp_path: Path) -> None:
    """A server that listens only after 1.5 s and then answers /health 503 for 1.5 s more (a model
    loading): the run waits, then sends every request with the model the server lists."""
    trace, prompts = files
    state = StandIn()
    state.listed = ["late-model"]
    state.unhealthy_until = time.perf_counter() + 3.0
    cfg_kw = dict(prompts=prompts, trace=trace, speedup=10.0, max_tokens_cap=2, progress=False)
    with serving(state, delay_s=1.5) as url:
        start = time.monotonic()
        s = replay(ReplayConfig(url=url, out=tmp_path / "run", wait_s=30.0, **cfg_kw))
        waited = time.monotonic() - start
    assert waited >= 3.0
    assert state.health_polls >= 2  # answered 503 at least once before the 200
    assert s.succeeded == s.requests == len(ROWS) and s.settings["model"] == "late-model"
    assert state.models_seen and set(state.models_seen) == {"late-model"}
    assert s.settings["max_context"] == CONTEXT


@pytest.mark.parametrize(
    ("listed", "models_status", "wanted", "match"),
    [
        ([], 200, None, "lists no model"),
        (["standin"], 500, None, "answered HTTP 500"),
        (["a", "b"], 200, None, "lists 2 models \\(a, b\\); choose one with --model"),
        (["a", "b"], 200, "c", "--model 'c' is not served: .* lists a, b"),
    ],
)
def test_never_sends_a_guessed_model_name(
    standin, files, tmp_path: Path, listed, models_status, wanted, match
) -> None:
    state, url = standin
    trace, prompts = files
    state.listed, state.models_status = listed, models_status
    sent_before = len(state.models_seen)
    try:
        with pytest.raises(ServerUnavailable, match=match) as err:
            replay(
                ReplayConfig(
                    url=url,
                    prompts=prompts,
                    trace=trace,
                    speedup=10.0,
                    model=wanted,
                    out=tmp_path / "run",
                    progress=False,
                    wait_s=1.0,
                )
            )
    finally:
        state.listed, state.models_status = ["standin"], 200
    assert isinstance(err.value, ClientError) and "\n" not in str(err.value)
    assert len(state.models_seen) == sent_before  # not one request, not even a sizing probe


def test_model_chosen_among_several_and_no_health_route(standin, files, tmp_path: Path) -> None:
    """``--model`` picks one of several listed models; a server whose /health is 404 (no such
    route) counts as ready once /v1/models answers."""
    state, url = standin
    trace, prompts = files
    state.listed, state.health_status = ["a", "b"], 404
    sent_before = len(state.models_seen)
    try:
        s = replay(
            ReplayConfig(
                url=url,
                prompts=prompts,
                trace=trace,
                speedup=10.0,
                max_requests=3,
                max_tokens_cap=2,
                model="b",
                out=tmp_path / "run",
                progress=False,
                wait_s=1.0,
            )
        )
    finally:
        state.listed, state.health_status = ["standin"], 200
    assert s.succeeded == 3 and set(state.models_seen[sent_before:]) == {"b"}


def test_cli_replay_and_sweep(standin, files, tmp_path: Path, capsys) -> None:
    state, url = standin
    state.mode = "ok"
    trace, prompts = files
    rc = main(
        [
            "replay",
            "--url",
            url,
            "--trace",
            str(trace),
            "--prompts",
            str(prompts),
            "--speedup",
            "4",
            "--max-tokens-cap",
            "2",
            "--out",
            str(tmp_path / "r"),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["succeeded"] == len(ROWS)
    rc = main(
        [
            "bench",
            "sweep",
            "--url",
            url,
            "--trace",
            str(trace),
            "--prompts",
            str(prompts),
            "--rates",
            "20,40",
            "--max-requests",
            "4",
            "--max-tokens-cap",
            "2",
            "--pause",
            "0",
            "--out",
            str(tmp_path / "s"),
            "--no-progress",
            "--json",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["rps"] for r in rows] == [20.0, 40.0] and all(r["hit_rate"] == 0.75 for r in rows)
    assert (tmp_path / "s" / "sweep-latency.png").stat().st_size > 0
    assert (tmp_path / "s" / "sweep-hitrate.png").stat().st_size > 0


def test_cli_says_why_the_offered_rate_is_not_the_target(
    standin, files, shared_data: Path, tmp_path: Path, capsys
) -> None:
    """The conv trace's first seconds are sparse: at --rps 20 the 3 s window offers about 4.8 req/s.
    The schedule line and the report say so, each on one whole line, and summary.json holds it."""
    state, url = standin
    state.mode = "ok"
    _, prompts = files
    trace = shared_data / "arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
    args = ["--url", url, "--trace", str(trace), "--prompts", str(prompts), "--rps", "20", "--duration", "3"]
    rc = main(["replay", *args, "--max-tokens-cap", "1", "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 0
    lines = capsys.readouterr().err.splitlines()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    note = summary["rate_note"]
    offered = summary["offered_rps"]
    assert note.startswith(f"offered {offered:.3g} req/s against --rps 20: the 3 s window covers ")
    assert note.endswith("comes closer") and "sparser than the 5.53 req/s average of the whole file" in note
    assert summary["target_rps"] == 20.0 and summary["requests"] == summary["succeeded"] == 15
    assert summary["sent_rps"] == pytest.approx(summary["offered_rps"], rel=0.1)
    assert any(line.startswith("schedule: 15 requests over ") and line.endswith(note) for line in lines)
    assert note in lines  # the report's line, whole
    assert note in (tmp_path / "r" / "summary.txt").read_text().splitlines()


def test_cli_bad_trace_is_one_line_error(files, tmp_path: Path, capsys) -> None:
    _, prompts = files
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,10,2\nnot-a-time,1,1\n")
    rc = main(
        [
            "replay",
            "--url",
            "http://127.0.0.1:9",
            "--trace",
            str(bad),
            "--prompts",
            str(prompts),
            "--rps",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("moeserve: error: ") and f"{bad}:3:" in err and "\n" not in err


LONG_ROWS = [  # context lengths over the stand-in's 512-token context, and under it
    "2023-11-16 18:15:46.0000000,2459,3",
    "2023-11-16 18:15:46.0100000,700,4",
    "2023-11-16 18:15:46.0200000,300,2",
    "2023-11-16 18:15:46.0300000,505,4",
    "2023-11-16 18:15:46.0400000,40,2",
    "2023-11-16 18:15:46.0500000,1200,1",
]


@pytest.mark.parametrize("how", ["tokenize", "calibrate", "fixed"])
def test_prompts_fit_the_servers_context_without_flags(standin, tmp_path: Path, how: str) -> None:
    """The README's replay failed 14% of requests: prompts sized at 4 chars/token, the server's
    tokenizer has fewer. Sized by /tokenize, or by a probe's usage, none is over the context."""
    state, url = standin
    state.mode, state.tokenize = "ok", how == "tokenize"
    trace = tmp_path / "long.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(LONG_ROWS) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    words = "The quick brown fox jumps over the lazy dog and keeps running far away. "
    prompts.write_text(
        "\n".join(json.dumps({"dataset": "d", "task": f"t{i}", "prompt": words * (i + 1)}) for i in range(4))
    )
    cfg = ReplayConfig(
        url=url,
        prompts=prompts,
        trace=trace,
        speedup=10.0,
        out=tmp_path / "run",
        progress=False,
        chars_per_token=4.0 if how == "fixed" else None,
    )
    try:
        s = replay(cfg)
    finally:
        state.tokenize = True
    recs = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    if how == "fixed":  # the old default: prompts twice as long as the client believes
        assert s.errors.get("http_error 400", 0) >= 2
        return
    assert s.succeeded == s.requests == len(LONG_ROWS), s.errors
    assert s.settings["prompts_cut"] == 4  # the rows asking 2459, 700, 505 and 1200 tokens
    prompt_tokens = [r["prompt_tokens"] for r in recs]
    assert all(p + r["max_tokens"] <= CONTEXT for p, r in zip(prompt_tokens, recs, strict=True))
    if how == "tokenize":
        assert s.settings["prompt_length"] == "server /tokenize"
        # exact sizing: each prompt is its target (trace length or the context budget), BOS aside
        budgets = [
            min(int(row.split(",")[1]), CONTEXT - r["max_tokens"] - 8)
            for row, r in zip(LONG_ROWS, recs, strict=True)
        ]
        assert [p - 1 for p in prompt_tokens] == budgets
    else:
        # the probe: 512 characters of the mix = 256 tokens + BOS; sized at that / 1.2
        assert s.settings["prompt_length"] == f"{512 / 257 / 1.2:.2f} chars/token (server's 1.99 / 1.2)"
