"""``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /version``, ``GET /health``, ``GET /metrics``.

``/v1/models`` entries carry ``max_model_len`` (vLLM's field); ``/v1/models/{id}`` answers 404
``model_not_found`` for any id but the served one. ``/version`` is ``{"version": ...}``, the
installed package version (``moeserve --version``).

``/health`` is 200 while the engine thread runs and 503 once it died (or while the server drains
for shutdown), so a load balancer or Kubernetes probe stops routing to it. ``/health`` and
``/metrics`` never need the API key; ``/v1/models`` does when one is set.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from server.protocol import ModelCard, ModelList
from server.routes.common import check_model, get_state
from server.state import ServerState


def _card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.settings.served_model_name, created=state.created, max_model_len=state.max_model_len
    )


def make_router(auth: Depends) -> APIRouter:
    """``auth`` guards ``/v1/models`` and ``/v1/models/{id}`` (the API-key dependency)."""
    router = APIRouter()

    @router.get("/v1/models", dependencies=[auth])
    async def list_models(request: Request) -> ModelList:
        return ModelList(data=[_card(get_state(request))])

    @router.get("/v1/models/{model_id:path}", dependencies=[auth])
    async def retrieve_model(model_id: str, request: Request) -> ModelCard:
        state = get_state(request)
        check_model(state, model_id)
        return _card(state)

    @router.get("/version")
    async def server_version() -> JSONResponse:
        from moeserve import __version__

        return JSONResponse({"version": __version__})

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
