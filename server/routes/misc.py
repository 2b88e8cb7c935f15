"""``GET /v1/models``, ``GET /health`` and ``GET /metrics``.

``/health`` is 200 while the engine thread runs and 503 once it died (or while the server drains
for shutdown), so a load balancer or Kubernetes probe stops routing to it. ``/health`` and
``/metrics`` never need the API key; ``/v1/models`` does when one is set.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from server.protocol import ModelCard, ModelList
from server.routes.common import get_state


def make_router(auth: Depends) -> APIRouter:
    """``auth`` guards ``/v1/models`` (the API-key dependency)."""
    router = APIRouter()

    @router.get("/v1/models", dependencies=[auth])
    async def list_models(request: Request) -> ModelList:
        state = get_state(request)
        card = ModelCard(
            id=state.settings.served_model_name, created=state.created, max_model_len=state.max_model_len
        )
        return ModelList(data=[card])

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        client = get_state(request).client
        if client.dead is not None or not client.alive:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        if client.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
