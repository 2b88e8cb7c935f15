"""Drain at shutdown: requests still open when ``--drain-timeout`` expires are answered (a JSON
503 ``shutting_down``, or an SSE error event then ``[DONE]``), before uvicorn's own graceful
timeout, which sits above ours, would cancel them."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from server.settings import DRAIN_GRACE_S, ServerSettings
from server.testing import serve_in_thread

# a slow emulated link and a 2-slot buffer: each step waits for expert copies, so a long request
# is still running at a short drain deadline
SLOW = RuntimeConfig(max_batch_size=4, buffer_slots=2, link_gbps=0.02)
LONG = {"prompt": "The quick", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, SLOW) as engine:
        yield engine


def test_open_requests_get_503_shutting_down_at_the_drain_deadline(engine):
    settings = ServerSettings(drain_timeout_s=0.5, max_wait_ms=0)
    stream_lines: list[str] = []
    plain: list[httpx.Response] = []
    first_chunk = threading.Event()
    with serve_in_thread(engine, settings, close_engine=False) as running:
        assert running.server.config.timeout_graceful_shutdown == 0.5 + DRAIN_GRACE_S
        url = running.base_url + "/v1/completions"

        def stream() -> None:
            with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        stream_lines.append(line)
                        first_chunk.set()

        def whole() -> None:
            plain.append(httpx.post(url, json=LONG, timeout=60))

        readers = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in readers:
            t.start()
        assert first_chunk.wait(30)
        deadline = time.monotonic() + 30
        while engine.num_running < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
    shutdown_s = time.monotonic() - t0
    for t in readers:
        t.join(30)
    assert shutdown_s < 0.5 + DRAIN_GRACE_S  # answered at our deadline, not cut at uvicorn's
    assert stream_lines[-1] == "data: [DONE]"
    error = json.loads(stream_lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
    assert any('"text"' in line for line in stream_lines[:-2])  # it was mid-generation
    (r,) = plain
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "shutting_down"
    registry = running.app.state.server.metrics.registry
    assert registry.get_sample_value("moeserve_requests_rejected_total", {"reason": "shutting_down"}) == 1
    assert engine.num_running == 0 and engine.num_waiting == 0
