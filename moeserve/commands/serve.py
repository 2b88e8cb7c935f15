"""``moeserve serve``: the OpenAI-compatible HTTP server (``docs/server.md``) under uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from moeserve.commands.common import (
    add_model_arg,
    add_runtime_args,
    dtype_needs_checkpoint,
    model_source,
    runtime_from_args,
)

API_KEY_ENV = "MOESERVE_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_arg(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (shown by ps: prefer ${API_KEY_ENV} or "
        "--api-key-file)",
    )
    g.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"read the API key from this file (first line); default: ${API_KEY_ENV} if set",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the repo id org/name for a Hub model or a folder in a "
        "Hugging Face cache, else the model folder's name)",
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
        help="on shutdown, seconds open requests may take to finish; then they get 503 shutting_down",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="close a keep-alive connection idle this many seconds after a response (default: 5)",
    )
    g.add_argument(
        "--timeout-header",
        type=float,
        default=10.0,
        help="close a connection whose request head is not complete after this many seconds (default: 10)",
    )
    g.add_argument(
        "--timeout-body",
        type=float,
        default=30.0,
        help="close a connection whose request body is not complete this many seconds after its head "
        "(default: 30)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="most open connections + running requests; beyond it uvicorn answers 503 (default: unlimited)",
    )
    g.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds sent with a 429")
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
    t.add_argument(
        "--eamc-on-corrupt",
        choices=["fail", "reset"],
        default="fail",
        help="a corrupt --eamc-path file: refuse to start (fail, default) or start empty (reset)",
    )
    add_runtime_args(p)
    p.set_defaults(func=run)


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key``, ``--api-key-file`` or ``$MOESERVE_API_KEY`` (first one set).

    Raises:
        ConfigError: both flags given, the file unreadable, or the key empty.
    """
    from moe_runtime.errors import ConfigError

    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ConfigError(f"--api-key-file {args.api_key_file}: cannot read ({reason})") from None
        key, source = (lines[0].strip() if lines else ""), f"--api-key-file {args.api_key_file}"
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV].strip(), f"${API_KEY_ENV}"
    else:
        return None
    if not key:
        raise ConfigError(f"{source}: the API key is empty")
    return key


def _settings(args: argparse.Namespace, model_name: str) -> Any:
    from server.settings import ServerSettings

    return ServerSettings(
        served_model_name=args.served_model_name or model_name,
        api_key=_api_key(args),
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        eamc_save_every=args.eamc_save_every,
        timeout_keep_alive_s=args.timeout_keep_alive,
        timeout_header_s=args.timeout_header,
        timeout_body_s=args.timeout_body,
        limit_concurrency=args.limit_concurrency,
        retry_after_s=args.retry_after,
        allowed_origins=tuple(args.allowed_origins),
    )


def run(args: argparse.Namespace) -> int:
    """Check the flags, bind the address, then resolve and load the model and serve.

    Exit status (``docs/operations.md``): 0 a clean stop; 1 the server failed to start after the
    load, or the final EAMC save failed; 2 a bad flag or an address that cannot be bound (raised,
    the CLI prints it), before anything loads; 3 the engine died while serving; 4 the model could
    not be resolved or loaded.
    """
    from moe_runtime.errors import ConfigError
    from server.runner import bind_socket

    if args.eamc_save_every and args.eamc_path is None:
        raise ConfigError("--eamc-save-every needs --eamc-path")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    # every runtime flag checked; nothing of the model read yet (--dtype auto reads its config.json)
    runtime_from_args(args, dtype="fp32" if dtype_needs_checkpoint(args) else None)
    settings = _settings(args, "moeserve")  # every server flag checked (the API key file read)
    if args.eamc_path is not None:
        from server.tracing import check_eamc_path

        check_eamc_path(args.eamc_path)
    sock = bind_socket(args.host, args.port)  # a busy port fails now, not after a long load
    try:
        return _serve(args, settings, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, settings: Any, sock: Any) -> int:
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.errors import MoeServeError
    from moe_runtime.loader import load_checkpoint
    from server.app import create_app
    from server.runner import MODEL_EXIT, START_FAILED_EXIT, make_server
    from server.tracing import TraceHooks, build_tracing

    try:
        source = model_source(args)
        runtime = runtime_from_args(args, compile_decode=True)
        settings = dataclasses.replace(settings, served_model_name=args.served_model_name or source.name)
        loaded = load_checkpoint(source.path, runtime)
    except MoeServeError as exc:
        print(f"moeserve: error: {exc}", file=sys.stderr)
        return MODEL_EXIT
    recorder, eamc, closers = build_tracing(
        loaded.config, runtime.eamc_capacity, args.record_trace, args.eamc_path, args.eamc_on_corrupt
    )
    engine = LLMEngine(loaded, runtime, recorder, eamc=eamc)
    print(engine.summary(), file=sys.stderr, flush=True)
    if engine.compiled is not None:
        print("compiling the decode step (--enforce-eager skips it) ...", file=sys.stderr, flush=True)
    captured, seconds = engine.capture_graphs()  # before the first request, not during it
    if engine.compiled is not None:
        print(engine.compiled.report(captured, seconds), file=sys.stderr, flush=True)
    elif captured:
        print(f"decode graphs: {captured} captured in {seconds:.1f} s", file=sys.stderr, flush=True)
    trace = TraceHooks(engine, args.eamc_path, args.eamc_save_every, closers)
    app = create_app(engine, settings, trace)
    server = make_server(app, args.host, args.port, args.log_level)
    server.run(sockets=[sock])
    if trace.final_save_failed:
        print(f"moeserve: error: {trace.last_save_error}", file=sys.stderr)
        return START_FAILED_EXIT
    return 0 if server.started else START_FAILED_EXIT
