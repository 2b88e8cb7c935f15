"""``moeserve serve``: the OpenAI-compatible HTTP server (``docs/server.md``) under uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from moeserve.commands.common import add_model_arg, add_runtime_args, resolve_model, runtime_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_arg(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model folder name)"
    )
    g.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="auto-batching window: when idle, wait this long for more requests before a step (default: 5)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="most requests waiting beyond a full batch; then 429 (default: 256)",
    )
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; then 413")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on shutdown, seconds open requests may take to finish before they are aborted",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        help="CORS: browser origins allowed to call the API ('*' = any)",
    )
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    t = p.add_argument_group("tracing")
    t.add_argument("--record-trace", type=Path, default=None, help="append each request's expert trace here")
    t.add_argument("--eamc-path", type=Path, default=None, help="load (if present) and save the EAMC here")
    t.add_argument(
        "--eamc-save-every",
        type=int,
        default=0,
        help="save the EAMC after every N finished requests (default: only at shutdown)",
    )
    add_runtime_args(p)
    p.set_defaults(func=run)


def _settings(args: argparse.Namespace, model_dir: Path) -> Any:
    from server.settings import ServerSettings

    return ServerSettings(
        served_model_name=args.served_model_name or model_dir.resolve().name,
        api_key=args.api_key,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        eamc_save_every=args.eamc_save_every,
        allowed_origins=tuple(args.allowed_origins),
    )


def run(args: argparse.Namespace) -> int:
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.errors import ConfigError
    from moe_runtime.loader import load_checkpoint
    from server.app import create_app
    from server.runner import make_server
    from server.tracing import TraceHooks, build_tracing

    if args.eamc_save_every and args.eamc_path is None:
        raise ConfigError("--eamc-save-every needs --eamc-path")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    runtime = runtime_from_args(args)
    model_dir = resolve_model(args)
    settings = _settings(args, Path(model_dir))
    loaded = load_checkpoint(model_dir, runtime)
    recorder, eamc, closers = build_tracing(
        loaded.config, runtime.eamc_capacity, args.record_trace, args.eamc_path
    )
    engine = LLMEngine(loaded, runtime, recorder, eamc=eamc)
    print(engine.summary(), file=sys.stderr, flush=True)
    trace = TraceHooks(engine, args.eamc_path, args.eamc_save_every, closers)
    app = create_app(engine, settings, trace)
    server = make_server(app, args.host, args.port, args.log_level, settings.drain_timeout_s)
    server.run()
    return 0 if server.started else 1
