"""Running an app under uvicorn with a drain-aware shutdown (used by ``moeserve serve`` and tests)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI

ENGINE_DEAD_EXIT = 3
"""Exit status of a server process whose engine died (0 = clean stop, 1 = failed to start)."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which marks the engine client draining as soon as SIGINT/SIGTERM arrives.

    Requests that still arrive on open keep-alive connections then get 503 while running ones
    finish; uvicorn waits up to ``timeout_graceful_shutdown`` for them, then the app's lifespan
    exit drains the engine and saves the EAMC. After a SIGTERM the process then exits with
    status 0 (uvicorn alone would re-raise the signal); SIGINT still ends as an interrupt.

    When the engine dies (a device or runtime fault in a step), open requests get 503 and the
    server stops; :meth:`run` then raises ``SystemExit(ENGINE_DEAD_EXIT)`` so a supervisor
    restarts the process (run in another thread, as in tests, it just returns; ``engine_failed``
    says why).
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        app = config.app
        self.client = app.state.server.client if isinstance(app, FastAPI) else None
        self.engine_failed = False
        if self.client is not None:
            self.client.on_dead = self._engine_died

    def _engine_died(self, _: BaseException) -> None:
        self.engine_failed = True
        self.should_exit = True

    def run(self, sockets: Any = None) -> None:
        super().run(sockets=sockets)
        if self.engine_failed and threading.current_thread() is threading.main_thread():
            raise SystemExit(ENGINE_DEAD_EXIT)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.client is not None:
            self.client.draining = True
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and captured and captured[-1] == sig:
            captured.pop()  # a drained SIGTERM is a clean exit (status 0): uvicorn would re-raise it


def make_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    drain_timeout_s: float = 30.0,
) -> DrainingServer:
    """A uvicorn server for ``app`` (HTTP/1.1, lifespan on); call ``.run()`` to serve."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=drain_timeout_s,
    )
    return DrainingServer(config)
