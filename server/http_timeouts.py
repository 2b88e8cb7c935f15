"""Connection timeouts uvicorn lacks: a deadline for the request head and one for the body.

NOTE: why a protocol subclass. uvicorn 0.54's h11 protocol only times out a keep-alive
connection *after* a response (``timeout_keep_alive``); a connection that opens and sends nothing,
trickles its headers one byte at a time (slowloris) or never finishes its body is held forever,
and each one holds a file descriptor. :class:`TimeoutH11Protocol` keeps uvicorn's behaviour and
adds two timers driven by h11's view of the client (``conn.their_state``):

* ``IDLE`` (new connection, or after a response): the whole request head must arrive within
  ``timeout_header_s``. Unlike keep-alive, receiving bytes does not restart this timer.
* ``SEND_BODY`` (head read, body pending): the body must be complete within ``timeout_body_s``.

Once the request is read, no timer runs: a long generation is never cut. On expiry the connection
is closed; an app still waiting for the body then receives ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("moeserve.server")


class TimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus head and body deadlines; configure with :func:`protocol_class`.

    Class attributes:
        timeout_header_s: seconds for the request head (connection open or previous response
            to the end of the headers).
        timeout_body_s: seconds for the body (end of the headers to the end of the body).
        on_timeout: called with ``"header"`` or ``"body"`` when a connection is closed for it.
    """

    timeout_header_s: float = 10.0
    timeout_body_s: float = 30.0
    on_timeout: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "header", "body" or None (no deadline running)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def _update_deadline(self) -> None:
        if self.transport is None or self.transport.is_closing():
            self._set_deadline(None)
            return
        state = self.conn.their_state
        self._set_deadline("header" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _set_deadline(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # keep the running timer: bytes arriving do not extend it
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            delay = self.timeout_header_s if phase == "header" else self.timeout_body_s
            self._deadline = self.loop.call_later(delay, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        log.debug("closing a connection from %s: request %s timeout", self.client, phase)
        if self.on_timeout is not None:
            self.on_timeout(phase)
        self.transport.close()


def protocol_class(
    timeout_header_s: float, timeout_body_s: float, on_timeout: Callable[[str], None] | None = None
) -> type[TimeoutH11Protocol]:
    """A :class:`TimeoutH11Protocol` subclass with these deadlines (uvicorn ``Config(http=...)``)."""
    attrs = {
        "timeout_header_s": timeout_header_s,
        "timeout_body_s": timeout_body_s,
        "on_timeout": staticmethod(on_timeout) if on_timeout is not None else None,
    }
    return type("TimeoutH11Protocol", (TimeoutH11Protocol,), attrs)
