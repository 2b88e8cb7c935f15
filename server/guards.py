"""Request guards: the body-size limit (413) and the API-key check (401)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_body


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` when a chunked body passes the limit (FastAPI re-raises it)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


class BodyLimitMiddleware:
    """Reject request bodies larger than ``max_bytes`` with 413.

    A declared ``Content-Length`` over the limit is refused before the body is read; a body sent
    without one (chunked) is counted as it arrives and refused once it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_json(send, 400, error_body(400, "invalid Content-Length", "invalid_value"))
                return
            if size > self.max_bytes:
                msg = f"the request body has {size} bytes; the limit is {self.max_bytes}"
                await _send_json(send, 413, error_body(413, msg, "request_too_large"))
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def api_key_guard(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency demanding ``Authorization: Bearer <api_key>`` (no-op when None).

    Raises:
        APIError: 401 when the header is missing, not a bearer token, or the wrong key.
    """

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key")
        if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", "invalid_api_key")

    return check
