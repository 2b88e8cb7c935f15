"""The app factory: one FastAPI app per engine, all state on ``app.state.server``.

Lifespan: on start the engine thread starts; on exit (uvicorn's shutdown, e.g. after SIGTERM)
new requests get 503, open requests drain for up to ``drain_timeout_s`` (then are answered with
503 ``shutting_down``; ``server/runner.py`` starts this drain as uvicorn's shutdown begins), the
engine thread stops, the EAMC is saved (when configured) and the engine is closed.

Middleware, outermost first: response counting (``/metrics``), the API key (before any body is
read), the body-size limit, ``Retry-After`` on 429.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.engine_client import EngineClient
from server.errors import install_error_handlers
from server.guards import ApiKeyMiddleware, BodyLimitMiddleware, RetryAfterMiddleware, api_key_guard
from server.metrics import HTTPMetricsMiddleware, ServerMetrics
from server.routes import chat, completions, misc, tokenize
from server.settings import ServerSettings
from server.state import ServerState
from server.tracing import TraceHooks

log = logging.getLogger("moeserve.server")


def create_app(
    engine: Any,
    settings: ServerSettings | None = None,
    trace: TraceHooks | None = None,
    close_engine: bool = True,
) -> FastAPI:
    """Build the OpenAI-compatible app serving ``engine``.

    Args:
        engine: an :class:`~moe_runtime.engine.engine.LLMEngine` no other thread uses; the app's
            engine thread becomes its only caller while the app runs.
        settings: HTTP settings (defaults: :class:`ServerSettings`).
        trace: tracer hooks (EAMC saving, trace writers); default: report ``engine.eamc``, if
            any, in ``/metrics`` and save nothing.
        close_engine: close the engine when the app shuts down.
    """
    settings = settings or ServerSettings()
    trace = trace if trace is not None else TraceHooks(engine)
    client = EngineClient(
        engine,
        max_wait_ms=settings.max_wait_ms,
        max_queue=settings.max_queue,
        after_step=trace.after_step,
    )
    metrics = ServerMetrics(client, trace)
    client.on_finished = metrics.observe

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.start()
        log.info("serving %r", settings.served_model_name)
        try:
            yield
        finally:
            await client.drain(settings.drain_timeout_s)
            try:
                await asyncio.to_thread(trace.close)
            finally:
                if close_engine:
                    engine.close()

    app = FastAPI(title="moeserve", version="0.1.0", lifespan=lifespan)
    app.state.server = ServerState(
        settings=settings,
        client=client,
        metrics=metrics,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        created=int(time.time()),
        trace=trace,
    )
    install_error_handlers(app)
    auth = Depends(api_key_guard(settings.api_key))
    app.include_router(completions.make_router(), dependencies=[auth])
    app.include_router(chat.make_router(), dependencies=[auth])
    app.include_router(misc.make_router(auth))
    app.include_router(tokenize.make_router(), dependencies=[auth])
    # added innermost first: metrics -> API key -> body limit -> Retry-After -> internal errors
    # (install_error_handlers) -> routes
    app.add_middleware(RetryAfterMiddleware, seconds=settings.retry_after_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, router=app.router)
    if settings.allowed_origins:  # outermost, so preflights are answered before auth or limits
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
