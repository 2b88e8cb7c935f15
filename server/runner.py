"""Running an app under uvicorn: connection limits, a drain that answers, calm accept errors.

Used by ``moeserve serve`` and :func:`server.testing.serve_in_thread`.

NOTE: shutdown order. On SIGINT/SIGTERM (or ``should_exit``) uvicorn closes the listening
sockets, asks every connection to close after its response, and waits up to
``timeout_graceful_shutdown`` before cancelling the request tasks; only then does the app's
lifespan exit run. :class:`DrainingServer` therefore starts the engine drain when uvicorn's
shutdown starts, not in the lifespan: open requests get ``drain_timeout_s`` to finish, then each
still open is answered with 503 ``shutting_down`` (a JSON body, or an SSE error event and
``[DONE]``), and uvicorn's own timeout sits ``DRAIN_GRACE_S`` above ours so those answers are
written before it would cancel anything.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from moe_runtime.errors import ConfigError
from server.http_timeouts import protocol_class
from server.settings import DRAIN_GRACE_S, ServerSettings

log = logging.getLogger("moeserve.server")

START_FAILED_EXIT = 1
"""Exit status of a server that failed to start after its model loaded, or whose final EAMC save
at shutdown failed (0 = clean stop)."""
USAGE_EXIT = 2
"""A bad flag or value, or an address that cannot be bound (port in use, unknown host): nothing
was loaded. The CLI's status for every user error."""
ENGINE_DEAD_EXIT = 3
"""Exit status of a server process whose engine died while serving (a supervisor restarts it)."""
MODEL_EXIT = 4
"""The model could not be resolved or loaded: no such folder, a Hub repo not cached while offline,
not found or not accessible, or a checkpoint the loader refuses (including one that does not fit
in memory with the given flags)."""

ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message
CONCURRENCY_LIMIT = "Exceeded concurrency limit."  # uvicorn's warning, once per refused request


class Throttle:
    """Counts events and says when one may be reported: at most once per ``interval_s``."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.count = 0
        self._reported = 0
        self._last = -float("inf")

    def hit(self) -> int | None:
        """Count one event; the events since the last report when this one may be reported."""
        self.count += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return None
        since, self._last, self._reported = self.count - self._reported, now, self.count
        return since


class AcceptErrorLog:
    """An asyncio exception handler that reports accept failures at most once per interval.

    When the process runs out of file descriptors (``EMFILE``), asyncio logs every failed
    ``accept()`` with a traceback, up to the listen backlog per event-loop tick (a measured
    731,135 lines in 55 s). This handler counts them (``on_error``) and logs one line per
    ``interval_s`` with the number suppressed; every other loop error goes to the default handler.
    """

    def __init__(self, interval_s: float = 10.0, on_error: Any | None = None) -> None:
        self.throttle, self.on_error = Throttle(interval_s), on_error

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_ERROR:
            loop.default_exception_handler(context)
            return
        if self.on_error is not None:
            self.on_error()
        since = self.throttle.hit()
        if since is not None:
            log.error(
                "cannot accept connections: %s (%d failed accepts since the last report; "
                "raise the open-file limit or lower --limit-concurrency)",
                context.get("exception"),
                since,
            )


class ThrottledMessage(logging.Filter):
    """Lets ``message`` through at most once per ``interval_s``, with the count since the last.

    Installed on ``uvicorn.error`` for uvicorn's per-request "Exceeded concurrency limit." warning
    (``--limit-concurrency``), which would otherwise log once per refused request.
    """

    def __init__(self, message: str, interval_s: float = 10.0) -> None:
        super().__init__()
        self.message, self.throttle = message, Throttle(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.message:
            return True
        since = self.throttle.hit()
        if since is None:
            return False
        record.msg, record.args = f"{self.message} ({since} request(s) refused since the last report)", ()
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain described in the module docstring.

    After a SIGTERM the process exits with status 0 (uvicorn alone would re-raise the signal);
    SIGINT still ends as an interrupt.

    When the engine dies (a device or runtime fault in a step), open requests get 503 and the
    server stops; :meth:`run` then raises ``SystemExit(ENGINE_DEAD_EXIT)`` so a supervisor
    restarts the process (run in another thread, as in tests, it just returns; ``engine_failed``
    says why).
    """

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float = 30.0) -> None:
        super().__init__(config)
        app = config.app
        state = app.state.server if isinstance(app, FastAPI) else None
        self.client = state.client if state is not None else None
        self.drain_timeout_s = drain_timeout_s
        on_error = state.metrics.accept_error if state is not None else None
        self.accept_errors = AcceptErrorLog(on_error=on_error)
        self.concurrency_log = ThrottledMessage(CONCURRENCY_LIMIT)
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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.accept_errors)
        logging.getLogger("uvicorn.error").addFilter(self.concurrency_log)
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = None
        if self.client is not None:
            self.client.draining = True
            drain = asyncio.ensure_future(self.client.drain(self.drain_timeout_s, stop=False))
        try:
            await super().shutdown(sockets)
        finally:
            logging.getLogger("uvicorn.error").removeFilter(self.concurrency_log)
            if drain is not None:
                if not drain.done():
                    drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)


_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use (another process listens there; pick another --port)",
    errno.EADDRNOTAVAIL: "not an address of this machine",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), as uvicorn binds one: IPv6 when
    ``host`` has a ``:``, ``SO_REUSEADDR`` set. Hand it to :meth:`DrainingServer.run`; until then
    connections are refused, as if nothing listened.

    ``moeserve serve`` binds before it loads the model, so a busy port or a bad host fails in
    milliseconds rather than after the load.

    Raises:
        ConfigError: ``"cannot bind HOST:PORT: <why>"`` (address in use, unknown host, not local,
            permission denied).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except socket.gaierror as exc:
        sock.close()
        raise ConfigError(f"cannot bind {shown}: unknown host ({exc.strerror})") from None
    except OSError as exc:
        sock.close()
        reason = _BIND_REASONS.get(exc.errno) or exc.strerror or str(exc)
        raise ConfigError(f"cannot bind {shown}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def make_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> DrainingServer:
    """A uvicorn server for ``app`` (HTTP/1.1 over h11, lifespan on); call ``.run()`` to serve.

    Timeouts, ``limit_concurrency`` and the drain timeout come from the app's
    :class:`~server.settings.ServerSettings`.
    """
    state = app.state.server
    settings: ServerSettings = state.settings
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=protocol_class(
            settings.timeout_header_s, settings.timeout_body_s, state.metrics.connection_timeout
        ),
        timeout_keep_alive=settings.timeout_keep_alive_s,
        limit_concurrency=settings.limit_concurrency,
        timeout_graceful_shutdown=settings.drain_timeout_s + DRAIN_GRACE_S,
    )
    return DrainingServer(config, settings.drain_timeout_s)
