"""Connection limits and the HTTP edge: head/body/keep-alive deadlines close slow and idle
clients while ``/health`` stays fast; running out of file descriptors logs a line, not a flood;
the API key (also from the environment or a file) is checked before the body; responses and
rejections are counted in ``/metrics`` (``Retry-After`` on 429: ``test_server_lifecycle.py``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.errors import ConfigError
from moeserve.commands import serve
from server.settings import ServerSettings
from server.testing import free_port, serve_in_thread, wait_until_healthy
from server.tracing import TraceHooks


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=2)) as engine:
        yield engine


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """True when the server closes ``sock`` within ``timeout_s`` (reads past any response)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_idle_and_slow_clients_are_closed_while_health_stays_fast(engine):
    settings = ServerSettings(timeout_header_s=1.0, timeout_body_s=1.0, timeout_keep_alive_s=1.0)
    with serve_in_thread(engine, settings, close_engine=False) as running:
        address = ("127.0.0.1", int(running.base_url.rsplit(":", 1)[1]))
        idle = [socket.create_connection(address) for _ in range(100)]
        slow_head = [socket.create_connection(address) for _ in range(50)]
        slow_body = [socket.create_connection(address) for _ in range(10)]
        for s in slow_head:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for s in slow_body:
            s.sendall(head + b'Content-Length: 100\r\n\r\n{"prompt": ')
        kept_alive = socket.create_connection(address)
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        latencies = []
        for _ in range(5):  # slowloris: a byte every 0.2 s never extends the head deadline
            for s in slow_head:
                with contextlib.suppress(OSError):  # already closed by the deadline
                    s.send(b"X")
            start = time.monotonic()
            assert httpx.get(running.base_url + "/health", timeout=5).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.2)
        # never held until the slow clients' 1 s deadline; the first request may pay a cold
        # start on a loaded 2-core host (0.67 s seen once), so the median carries the 0.5 s bound
        assert max(latencies) < 1.0 and sorted(latencies)[2] < 0.5, latencies
        for s in idle + slow_head + slow_body + [kept_alive]:
            assert closed_by_server(s, max(0.1, t0 + 4.0 - time.monotonic()))
            s.close()
        assert time.monotonic() - t0 < 4.0
        text = httpx.get(running.base_url + "/metrics").text
        assert sample(text, "moeserve_connection_timeouts_total", phase="header") >= 150
        assert sample(text, "moeserve_connection_timeouts_total", phase="body") == 10
        r = httpx.post(running.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200  # still serving


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_limit_concurrency_refuses_with_503_and_logs_once(engine):
    records = _Records()
    with serve_in_thread(engine, ServerSettings(limit_concurrency=3), close_engine=False) as running:
        logging.getLogger("uvicorn.error").addHandler(records)  # after uvicorn configured logging
        try:
            address = ("127.0.0.1", int(running.base_url.rsplit(":", 1)[1]))
            held = [socket.create_connection(address) for _ in range(3)]
            time.sleep(0.2)
            for _ in range(5):
                r = httpx.get(running.base_url + "/health", timeout=5)
                assert r.status_code == 503 and r.text == "Service Unavailable"
            for s in held:
                s.close()
            time.sleep(0.2)
            assert httpx.get(running.base_url + "/health", timeout=5).status_code == 200
        finally:
            logging.getLogger("uvicorn.error").removeHandler(records)
    refused = [m for m in records.messages if m.startswith("Exceeded concurrency limit.")]
    assert refused == ["Exceeded concurrency limit. (1 request(s) refused since the last report)"]


def _open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_out_of_file_descriptors_logs_a_line_not_a_flood_and_recovers(tiny_qwen3):
    """With the open-file limit reached, the accept error is logged once per 10 s (asyncio alone
    logs it up to the listen backlog per loop tick); the head deadline frees descriptors and
    ``/health`` answers again."""
    port = free_port()
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(tiny_qwen3), "--port", str(port)]
    cmd += ["--log-level", "warning", "--timeout-header", "1", "--timeout-keep-alive", "1", "--enforce-eager"]
    limit = 48

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, preexec_fn=bounded)
    base = f"http://127.0.0.1:{port}"
    clients: list[socket.socket] = []
    try:
        wait_until_healthy(base, proc)
        free = limit - _open_fds(proc.pid)
        assert free > 0
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(free + 40)]
        time.sleep(1.5)  # the server hit EMFILE and kept failing accept() meanwhile
        t0 = time.monotonic()
        assert httpx.get(base + "/health", timeout=15).status_code == 200
        recovered_s = time.monotonic() - t0
        text = httpx.get(base + "/metrics", timeout=5).text
        assert sample(text, "moeserve_accept_errors_total") >= 1
        assert sample(text, "moeserve_connection_timeouts_total", phase="header") >= free
        assert all(closed_by_server(s, 10) for s in clients)
    finally:
        for s in clients:
            s.close()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert 1 <= err.count("cannot accept connections") <= 2, err[-2000:]  # one per 10 s
    assert "socket.accept() out of system resource" not in err
    assert recovered_s < 12


@pytest.fixture
def keyed(engine):
    settings = ServerSettings(api_key="sekret", max_body_bytes=1000)
    with serve_in_thread(engine, settings, close_engine=False) as running:
        yield running


def test_api_key_is_checked_before_the_body(keyed):
    http = httpx.Client(base_url=keyed.base_url, timeout=30)
    bad_json = {"content": b"{not json", "headers": {"content-type": "application/json"}}
    big = {"content": b"x" * 5000, "headers": {"content-type": "application/json"}}
    for kwargs in (bad_json, big):
        r = http.post("/v1/completions", **kwargs)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r = http.post("/v1/completions", headers={"authorization": "Bearer wrong"}, content=b"{")
    assert r.status_code == 401 and r.json()["error"]["message"] == "incorrect API key"
    auth = {"authorization": "Bearer sekret"}
    r = http.post("/v1/completions", content=bad_json["content"], headers={**bad_json["headers"], **auth})
    assert r.status_code == 400
    assert (
        http.post("/v1/completions", content=big["content"], headers={**big["headers"], **auth}).status_code
        == 413
    )
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers=auth).status_code == 200
    assert http.get("/health").status_code == 200  # open without the key
    assert http.get("/nowhere").status_code == 404
    assert http.get("/v1/models/some-id").status_code == 401  # refused before routing
    text = http.get("/metrics").text
    assert sample(text, "moeserve_requests_rejected_total", reason="unauthorized") == 5
    assert (
        sample(text, "moeserve_requests_rejected_total", reason="invalid_request") == 2
    )  # the 400 and the 404
    assert sample(text, "moeserve_requests_rejected_total", reason="too_large") == 1
    assert sample(text, "moeserve_http_responses_total", route="/v1/completions", status="401") == 3
    assert sample(text, "moeserve_http_responses_total", route="/v1/models", status="200") == 1
    assert sample(text, "moeserve_http_responses_total", route="other", status="404") == 1
    # a path with a parameter is labelled with its template, never the client's path
    models_id = "/v1/models/{model_id:path}"
    assert sample(text, "moeserve_http_responses_total", route=models_id, status="401") == 1
    http.close()


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_api_key_from_environment_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MOESERVE_API_KEY", raising=False)
    assert serve._api_key(_args()) is None
    monkeypatch.setenv("MOESERVE_API_KEY", " from-env\n")
    assert serve._api_key(_args()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert serve._api_key(_args(api_key_file=key_file)) == "from-file"  # the file wins over the env
    assert serve._api_key(_args(api_key="flag")) == "flag"
    with pytest.raises(ConfigError, match="not both"):
        serve._api_key(_args(api_key="flag", api_key_file=key_file))
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match=r"--api-key-file .*key: the API key is empty"):
        serve._api_key(_args(api_key_file=key_file))
    with pytest.raises(ConfigError, match=r"cannot read \(No such file or directory\)"):
        serve._api_key(_args(api_key_file=tmp_path / "missing"))
    monkeypatch.setenv("MOESERVE_API_KEY", "")
    with pytest.raises(ConfigError, match=r"\$MOESERVE_API_KEY: the API key is empty"):
        serve._api_key(_args())


def test_failed_eamc_saves_show_in_metrics(engine, tmp_path):
    folder = tmp_path / "volume"
    folder.mkdir()
    hooks = TraceHooks(engine, folder / "eamc.npz", save_every=1, eamc=_EAMC())
    shutil.rmtree(folder)
    folder.write_text("not a folder")  # the save cannot create it again
    with serve_in_thread(engine, ServerSettings(eamc_save_every=1), hooks, close_engine=False) as running:
        r = httpx.post(
            running.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while hooks.save_failures < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        text = httpx.get(running.base_url + "/metrics").text
        assert sample(text, "moeserve_eamc_save_failures_total") >= 1
        assert sample(text, "moeserve_eamc_saves_total") == 0
    assert hooks.final_save_failed


class _EAMC:
    """An EAMC stand-in whose save writes through ``tracer.atomic`` like the real one."""

    def __len__(self) -> int:
        return 0

    def save(self, path: Path) -> None:
        from tracer.atomic import atomic_file

        with atomic_file(path, "wb") as f:
            f.write(b"eamc")
