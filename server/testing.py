"""A real uvicorn server on a free loopback port, in a background thread (tests, benchmarks).

    with serve_in_thread(engine, ServerSettings(...)) as running:
        openai.OpenAI(base_url=running.base_url + "/v1", api_key="x")

Startup is bounded by ``timeout_s``; leaving the block runs uvicorn's shutdown and the app's
lifespan exit (drain up to ``settings.drain_timeout_s``, EAMC save, engine close) and joins the
thread (waiting at most ``timeout_s`` more than the drain).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from server.app import create_app
from server.runner import DrainingServer, make_server
from server.settings import ServerSettings
from server.tracing import TraceHooks


@dataclass(slots=True)
class RunningServer:
    """Attributes: base_url (``http://127.0.0.1:<port>``), app, server (uvicorn), thread."""

    base_url: str
    app: FastAPI
    server: DrainingServer
    thread: threading.Thread

    @property
    def client(self) -> Any:
        """The app's :class:`~server.engine_client.EngineClient`."""
        return self.app.state.server.client


@contextmanager
def serve_in_thread(
    engine: Any,
    settings: ServerSettings | None = None,
    trace: TraceHooks | None = None,
    close_engine: bool = True,
    timeout_s: float = 30.0,
) -> Iterator[RunningServer]:
    """Serve ``engine`` on ``127.0.0.1:<free port>`` until the block exits.

    Raises:
        RuntimeError: the server did not start within ``timeout_s``.
    """
    app = create_app(engine, settings, trace, close_engine=close_engine)
    server = make_server(app, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app, server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout_s + app.state.server.settings.drain_timeout_s)
        sock.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a ``moeserve serve`` subprocess)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Poll ``base_url/health`` until it answers 200.

    Raises:
        RuntimeError: ``proc`` exited first, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become healthy")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
