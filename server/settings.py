"""Settings of the HTTP layer (the engine's own settings live in ``moe_runtime.config``)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.errors import ConfigError

DRAIN_GRACE_S = 5.0  # uvicorn's graceful-shutdown timeout = drain_timeout_s + this


@dataclass(slots=True)
class ServerSettings:
    """What ``moeserve serve`` flags choose for the HTTP service.

    Attributes:
        served_model_name: the one model id this server answers to (``/v1/models``; any other
            ``model`` in a request is a 404).
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``
            (401 otherwise); ``/health`` and ``/metrics`` stay open.
        max_wait_ms: auto-batching window (MoE-Infinity §7.4): when the engine is idle and a
            request arrives, wait up to this long for more before the first step (0 = never wait).
        max_queue: most engine requests waiting beyond a full batch (``max_batch_size``
            running); a request that would pass it gets 429.
        max_body_bytes: largest request body accepted; larger bodies get 413.
        drain_timeout_s: on shutdown, how long running requests may take to finish; then each
            still open gets a 503 ``shutting_down`` (a JSON error, or an SSE error event and
            ``[DONE]`` on a stream). uvicorn's own graceful-shutdown timeout is set
            ``DRAIN_GRACE_S`` above it, so those answers are written before uvicorn cancels.
        eamc_save_every: save the EAMC after every this many finished requests (0 = only at
            shutdown); needs an EAMC path.
        timeout_keep_alive_s: an idle keep-alive connection (no new request after a response)
            is closed after this many seconds (uvicorn's ``timeout_keep_alive``).
        timeout_header_s: a request's head (request line and headers) must arrive within this
            many seconds of the connection opening or the previous response; else the connection
            is closed. Also bounds a new connection that sends nothing.
        timeout_body_s: a request's body must arrive within this many seconds of its head; else
            the connection is closed and the request abandoned.
        limit_concurrency: most open connections plus running requests before uvicorn answers
            503 (plain text, before the app); None = unlimited.
        retry_after_s: the ``Retry-After`` header (seconds) sent with every 429.
        allowed_origins: CORS origins browsers may call from (``"*"`` = any; empty = no CORS).
    """

    served_model_name: str = "moeserve"
    api_key: str | None = None
    max_wait_ms: float = 5.0
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    eamc_save_every: int = 0
    timeout_keep_alive_s: float = 5.0
    timeout_header_s: float = 10.0
    timeout_body_s: float = 30.0
    limit_concurrency: int | None = None
    retry_after_s: int = 1
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("--served-model-name must not be empty")
        if self.max_wait_ms < 0:
            raise ConfigError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ConfigError(f"--drain-timeout must be a finite number >= 0, got {self.drain_timeout_s}")
        if self.eamc_save_every < 0:
            raise ConfigError(f"--eamc-save-every must be >= 0, got {self.eamc_save_every}")
        for flag, value in (
            ("--timeout-keep-alive", self.timeout_keep_alive_s),
            ("--timeout-header", self.timeout_header_s),
            ("--timeout-body", self.timeout_body_s),
        ):
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"{flag} must be a finite number of seconds > 0, got {value}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ConfigError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")
        if self.retry_after_s < 0:
            raise ConfigError(f"--retry-after must be >= 0, got {self.retry_after_s}")
