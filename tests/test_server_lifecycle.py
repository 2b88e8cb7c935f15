"""Server lifecycle: client disconnects abort, 429 on a full queue, 503 when draining or when the
engine died, EAMC saving hooks, and SIGTERM draining a real ``moeserve serve`` process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from server.settings import ServerSettings
from server.testing import serve_in_thread
from server.tracing import TraceHooks
from tracer.eamc import EAMC

LONG = {"prompt": "The quick", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=2)) as engine:
        yield engine


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def aborted(engine) -> int:
    return engine.stats.requests_finished.get("abort", 0)


def test_disconnect_frees_the_request(engine):
    with (
        serve_in_thread(engine, close_engine=False) as running,
        httpx.Client(base_url=running.base_url) as http,
    ):
        before = aborted(engine)
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert engine.num_running == 1
        wait_until(lambda: engine.num_running == 0 and aborted(engine) == before + 1)
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            http.post("/v1/completions", json={**LONG, "max_tokens": 250}, timeout=0.05)
        wait_until(lambda: engine.num_running == 0 and aborted(engine) == before + 2)
        wait_until(lambda: running.client.num_open == 0)
        m = http.get("/metrics").text
        assert f'moeserve_request_success_total{{finished_reason="abort"}} {before + 2}.0' in m
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def test_auto_batching_window_gathers_a_burst_into_one_step(engine):
    """MoE-Infinity §7.4: an idle engine waits up to max_wait_ms for more requests, and stops
    waiting as soon as max_batch_size (2 here) are waiting."""
    settings = ServerSettings(max_wait_ms=5000)
    with serve_in_thread(engine, settings, close_engine=False) as running:
        steps = engine.stats.steps
        body = {"prompt": "Paris", "max_tokens": 1, "temperature": 0}

        def one() -> None:
            assert httpx.post(running.base_url + "/v1/completions", json=body, timeout=30).status_code == 200

        t0 = time.monotonic()
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert engine.stats.steps - steps == 1  # both prefills (and their first tokens) in one step
        assert time.monotonic() - t0 < 4.0  # did not sit out the 5 s window: the batch was full


def test_429_when_the_queue_is_full_then_503_when_draining(engine):
    settings = ServerSettings(max_queue=1, max_wait_ms=0)
    with serve_in_thread(engine, settings, close_engine=False) as running:
        http = httpx.Client(base_url=running.base_url, timeout=30)
        streams = []
        try:
            for _ in range(3):  # both batch slots busy, then one waiting: the queue (1) is full
                streams.append(http.stream("POST", "/v1/completions", json={**LONG, "stream": True}))
                assert streams[-1].__enter__().status_code == 200
            r = http.post("/v1/completions", json=LONG)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"  # --retry-after
            m = http.get("/metrics").text
            assert 'moeserve_requests_rejected_total{reason="queue_full"} 1.0' in m
            assert 'moeserve_http_responses_total{route="/v1/completions",status="429"} 1.0' in m
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            http.close()
        wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
        running.client.draining = True
        r = httpx.post(running.base_url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(running.base_url + "/health").status_code == 503


def test_engine_death_is_503_then_the_server_stops(engine, monkeypatch):
    def boom() -> list:
        raise RuntimeError("simulated engine failure")

    monkeypatch.setattr(engine, "step", boom)
    with (
        serve_in_thread(engine, close_engine=False) as running,
        httpx.Client(base_url=running.base_url) as http,
    ):
        assert http.get("/health").status_code == 200
        assert "moeserve_engine_up 1.0" in http.get("/metrics").text
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "simulated" not in r.json()["error"]["message"]  # no internals leak
        running.thread.join(30)  # the server stops by itself, so a supervisor can restart it
        assert not running.thread.is_alive() and running.server.engine_failed
    monkeypatch.undo()
    for rid in list(engine._seqs):  # the failed request stayed in the engine
        engine.abort_request(rid)


class FakeEAMC:
    def __init__(self) -> None:
        self.saved: list[str] = []

    def __len__(self) -> int:
        return 3

    def save(self, path) -> None:
        self.saved.append(str(path))


def test_eamc_saved_every_n_and_at_shutdown(engine, tmp_path):
    eamc = FakeEAMC()
    hooks = TraceHooks(engine, tmp_path / "eamc", save_every=2, eamc=eamc)
    settings = ServerSettings(eamc_save_every=2)
    with serve_in_thread(engine, settings, hooks, close_engine=False) as running:
        for _ in range(4):
            r = httpx.post(
                running.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
            )
            assert r.status_code == 200
        wait_until(lambda: len(eamc.saved) == 2)
        assert "moeserve_eamc_entries 3.0" in httpx.get(running.base_url + "/metrics").text
    assert len(eamc.saved) == 3 and eamc.saved[-1] == str(tmp_path / "eamc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_running_requests_then_saves_the_eamc(tiny_qwen3, tmp_path):
    port, eamc_path, trace_path = free_port(), tmp_path / "eamc.npz", tmp_path / "trace.jsonl"
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(tiny_qwen3), "--port", str(port)]
    cmd += ["--served-model-name", "tiny", "--log-level", "warning", "--max-wait-ms", "0", "--enforce-eager"]
    cmd += ["--prefetch-policy", "eam", "--eamc-path", str(eamc_path), "--record-trace", str(trace_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 60)
        assert "moeserve_eamc_entries 0.0" in httpx.get(base + "/metrics").text
        events: list[dict] = []
        started = threading.Event()

        def stream() -> None:
            body = {**LONG, "max_tokens": 40, "stream": True, "model": "tiny"}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()
                    elif line == "data: [DONE]":
                        events.append({"done": True})

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert events[-1] == {"done": True}
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # ran to the end
        assert proc.wait(60) == 0
        assert "buffer" in proc.stderr.read()  # the engine summary line
        assert len(EAMC.load(eamc_path)) == 1  # the drained request's EAM, saved at shutdown
        assert len(trace_path.read_text().splitlines()) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_on_a_busy_port_fails_before_the_model_loads(tiny_qwen3, monkeypatch, capsys):
    """The address is bound first: a busy port is status 2 and one line at once, and the model is
    never resolved or loaded (here a load that would take a minute)."""
    from moe_runtime import loader
    from moeserve.cli import build_parser, main
    from server.runner import USAGE_EXIT

    build_parser()  # the subcommand modules imported before the clock starts

    touched: list[str] = []

    def slow_load(*args, **kwargs):
        touched.append("load")
        time.sleep(60)

    monkeypatch.setattr(loader, "load_checkpoint", slow_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        rc = main(["serve", "--model", str(tiny_qwen3), "--port", str(port)])
        elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert rc == USAGE_EXIT and not touched and elapsed < 10, (rc, touched, elapsed)  # the load: 60 s
    assert err == (
        f"moeserve: error: cannot bind 127.0.0.1:{port}: address already in use "
        "(another process listens there; pick another --port)"
    )


def test_serve_on_a_busy_port_entry_point(tiny_qwen3):
    """The same through the installed entry point: status 2, one line, no engine summary."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(tiny_qwen3), "--port", str(port)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"moeserve: error: cannot bind 127.0.0.1:{port}: address already in use "
        "(another process listens there; pick another --port)"
    ]
