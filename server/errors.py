"""Errors as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can see goes through here, so the shape never varies. Every 400 names
the field at fault in ``param`` (``messages.0.role``, ``prompt``, ...), or ``"body"`` when the
request as a whole is at fault (not JSON, not a JSON object):

====  ========================  ====================  =============================================
code  type                      error code            when
====  ========================  ====================  =============================================
400   invalid_request_error     invalid_value         a value out of range or over a limit (see
                                                      ``docs/server.md``), an unsupported option,
                                                      or a ``MoeServeError`` from the runtime
                                                      (e.g. the prompt is longer than the context)
400   invalid_request_error     invalid_schema        body is not JSON or does not fit the schema
                                                      (wrong type, missing field), as OpenAI and
                                                      vLLM answer it; ``param`` names the field
401   authentication_error      invalid_api_key       ``--api-key`` set, key missing or wrong
404   invalid_request_error     model_not_found       ``model`` is not the served model
404   invalid_request_error     not_found             no such route
413   invalid_request_error     request_too_large     body larger than ``--max-body-bytes``
429   rate_limit_error          queue_full            ``--max-queue`` requests already waiting
                                                      beyond a full batch
500   server_error              server_error          a bug, or this request's generation failed
                                                      (sampling/detokenising raised); the message
                                                      never carries exception text; the server
                                                      and the other requests keep going
503   service_unavailable       shutting_down /       draining for shutdown, or the engine died
                                engine_dead           (the process then exits to be restarted)
====  ========================  ====================  =============================================
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_runtime.errors import MoeServeError

log = logging.getLogger("moeserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error object.

    Args:
        status: HTTP status code.
        message: one line for the user.
        code: machine-readable error code (see the module table).
        param: the request field at fault, if any.
    """

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for ``status`` (also sent as an SSE event when a stream fails)."""
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def invalid(message: str, param: str) -> APIError:
    """A 400 for a value the server cannot honour; ``param`` names the field (``"messages.0.role"``)."""
    return APIError(400, message, "invalid_value", param)


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``; the body itself -> ``"body"``."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "int_parsing_size"}
"""pydantic error types that mean a value out of range, not a wrong shape: answered with 400."""


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors()) or [{"loc": (), "msg": "invalid request", "type": "invalid"}]
    first = errors[0]
    if all(e.get("type") in _RANGE_ERRORS for e in errors):
        loc = tuple(p for p in first.get("loc", ()) if p != "body")
        param = _loc_to_param(loc)
        return error_response(400, f"{param}: {first['msg']}", "invalid_value", param)
    if first.get("type") == "json_invalid":
        error = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"the body is not valid JSON: {error}", "invalid_schema", "body")
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, loc)) if a != b), min(len(common), len(loc)))
        common = common[:n]
    param = _loc_to_param(common)
    if len(errors) > 1 and common and all(len(loc) > len(common) for loc in locs):  # no union branch fits
        options = ", ".join(dict.fromkeys(str(loc[len(common)]) for loc in locs))
        message = f"{param}: matches none of the allowed forms ({options})"
    else:
        message = f"{_loc_to_param(locs[0])}: {first['msg']}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error(s))"
    return error_response(400, message, "invalid_schema", param)


async def _runtime_error(_: Request, exc: Exception) -> JSONResponse:
    """A runtime error a route did not map to a field (the routes check fields first): the
    exception's ``param`` when it has one, else ``"body"``."""
    return error_response(400, str(exc), "invalid_value", getattr(exc, "param", None) or "body")


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    code = codes.get(exc.status_code, "http_error")
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail), code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _internal_error(_: Request | None, exc: Exception) -> JSONResponse:
    log.exception("internal error while serving a request", exc_info=exc)
    return error_response(500, "the server had an error while processing the request", "server_error")


class InternalErrorMiddleware:
    """Answer an exception a route raised before its response started with the 500 OpenAI error
    and end the request there, keeping the connection open.

    Starlette hands a handler for ``Exception`` to its outermost ``ServerErrorMiddleware``, which
    sends that handler's response and then re-raises; uvicorn, seeing an exception after the
    response started, closes the connection, so a keep-alive client's next request on it fails
    with a connection reset (``tests/test_server_errors.py``). Installed innermost, just outside
    the routes, this catches the exception first, so the other middlewares (metrics, auth) see a
    plain 500 response. An exception after the response started (a stream cut short) is re-raised:
    that response cannot be finished, and closing the connection is right.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            await (await _internal_error(None, exc))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise onto an OpenAI error response. Call before adding
    any other middleware (:class:`InternalErrorMiddleware` must be the innermost)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(MoeServeError, _runtime_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)  # raised in a middleware outside the routes
    app.add_middleware(InternalErrorMiddleware)  # the first added: innermost (see its docstring)
