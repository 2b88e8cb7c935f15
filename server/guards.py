"""Request guards: the API-key check (401), the body-size limit (413), ``Retry-After`` on 429.

Order in the app (outermost first): API key, then body limit, so an unauthenticated client gets
401 whatever its body (too large, not JSON) and learns nothing about the limits.
"""

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


async def _send_json(
    send: Send, status: int, body: dict, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def check_api_key(authorization: str | None, api_key: str | None) -> APIError | None:
    """The 401 for this ``Authorization`` header value, or None when it carries ``api_key``."""
    if api_key is None:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key")
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "incorrect API key", "invalid_api_key")
    return None


class ApiKeyMiddleware:
    """Demand ``Authorization: Bearer <api_key>`` on paths under ``prefix`` before the body is read.

    A request without the key gets 401 (OpenAI error object, ``WWW-Authenticate: Bearer``) and its
    body is never parsed. Other paths (``/health``, ``/metrics``) stay open.
    """

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1/") -> None:
        self.app, self.api_key, self.prefix = app, api_key, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            raw = dict(scope.get("headers") or []).get(b"authorization")
            err = check_api_key(raw.decode("latin-1") if raw is not None else None, self.api_key)
            if err is not None:
                await _send_json(send, err.status, err.body(), [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class RetryAfterMiddleware:
    """Add ``Retry-After: <seconds>`` to every 429 the app sends (queue full)."""

    def __init__(self, app: ASGIApp, seconds: int) -> None:
        self.app, self.value = app, str(seconds).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry_after(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"retry-after"]
                message = {**message, "headers": [*headers, (b"retry-after", self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)


def api_key_guard(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The same check as a FastAPI dependency, for routes mounted outside ``/v1/``.

    Raises:
        APIError: 401 when the header is missing, not a bearer token, or the wrong key.
    """

    async def check(request: Request) -> None:
        err = check_api_key(request.headers.get("authorization"), api_key)
        if err is not None:
            raise err

    return check
