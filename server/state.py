"""Everything one app instance serves with, kept on ``app.state.server`` (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.engine_client import EngineClient
from server.metrics import ServerMetrics
from server.settings import ServerSettings
from server.tracing import TraceHooks


@dataclass(slots=True)
class ServerState:
    """Attributes:
    settings: the HTTP settings.
    client: the engine client (engine thread + asyncio bridge).
    metrics: the app's Prometheus registry and histograms.
    tokenizer: the checkpoint's tokenizer, or None (then only token-id prompts work).
    max_model_len: context length in tokens (prompt + output).
    created: Unix time the server started (``/v1/models``).
    trace: tracer hooks (EAMC saving and figures).
    """

    settings: ServerSettings
    client: EngineClient
    metrics: ServerMetrics
    tokenizer: Any | None
    max_model_len: int
    created: int
    trace: TraceHooks | None = None  # always set by create_app
