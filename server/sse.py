"""Server-sent events and client-disconnect handling.

NOTE: why a disconnect listener. A client that goes away must free its engine requests at once
(KV blocks, batch slot, pinned experts), not when the next token happens to be written: a request
still waiting for a batch slot writes nothing for a long time. So both helpers here watch the ASGI
``receive`` channel for ``http.disconnect`` while the response is produced, cancel the producer
when it arrives, and always run the ``on_close`` callback (which aborts whatever is still open;
aborting a finished request is a no-op).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """One SSE ``data:`` event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` response that stops producing as soon as the client disconnects.

    Args:
        events: async iterator of ready-made SSE strings (``sse_event`` / ``DONE``).
        on_close: called exactly once when the response ends for any reason.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type=self.media_type,
        )
        self.events, self.on_close = events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_events(send))
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
            if sender.done() and not sender.cancelled():
                exc = sender.exception()
                if exc is not None and not isinstance(exc, OSError):  # OSError: client went away
                    raise exc
        finally:
            sender.cancel()
            listener.cancel()
            self.on_close()

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(
    request: Request, work: Callable[[], Awaitable[T]], on_close: Callable[[], None]
) -> T | None:
    """Run ``work()`` while watching for a disconnect; None if the client left first.

    Exceptions of ``work()`` propagate; ``on_close`` runs in every case (it aborts what is still
    open).
    """
    worker = asyncio.ensure_future(work())
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({worker, listener}, return_when=asyncio.FIRST_COMPLETED)
        return worker.result() if worker.done() else None
    finally:
        worker.cancel()
        listener.cancel()
        on_close()
