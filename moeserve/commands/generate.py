"""``moeserve generate``: complete one prompt and print the text (or JSON with stats)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from moeserve.commands.common import add_model_arg, add_runtime_args, resolve_model, runtime_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt with the offloading runtime")
    add_model_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids (no tokenizer needed)")
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default: 64)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="finite, >= 0; below 1e-5 = greedy (default: 0)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; the top token is always kept")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="a signed 64-bit integer")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--record-trace", default=None, help="append this request's expert trace (JSONL) here")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"}')
    add_runtime_args(p)
    p.set_defaults(func=run)


def _prompt_ids(args: argparse.Namespace, engine) -> list[int]:
    from moe_runtime.errors import RequestError

    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise RequestError(
                f"--prompt-ids: {args.prompt_ids!r} is not a comma-separated list of ints"
            ) from None
    if engine.tokenizer is None:
        raise RequestError(f"{engine.loaded.path}: no tokenizer.json; pass --prompt-ids instead of --prompt")
    return engine.tokenizer.encode(args.prompt)


def _sampling_params(args: argparse.Namespace):
    """The request's ``SamplingParams``; a bad flag raises ``RequestError`` naming it."""
    from moe_runtime.engine.request import SamplingParams
    from moe_runtime.errors import RequestError

    checks = [
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, ">= 1"),
        (
            "--temperature",
            args.temperature,
            math.isfinite(args.temperature) and args.temperature >= 0,
            "a finite number >= 0",
        ),
        ("--top-p", args.top_p, math.isfinite(args.top_p) and 0 < args.top_p <= 1, "in (0, 1]"),
        ("--top-k", args.top_k, args.top_k >= -1, "-1, 0 or positive"),
        ("--seed", args.seed, args.seed is None or -(2**63) <= args.seed < 2**63, "a signed 64-bit integer"),
    ]
    for flag, value, ok, rule in checks:
        if not ok:
            raise RequestError(f"{flag} must be {rule}, got {value}")
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def run(args: argparse.Namespace) -> int:
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.loader import load_checkpoint

    runtime = runtime_from_args(args)
    params = _sampling_params(args)
    loaded = load_checkpoint(resolve_model(args), runtime)
    recorder = make_recorder(args.record_trace, loaded.config) if args.record_trace else None
    with LLMEngine(loaded, runtime, recorder) as engine:
        ids = _prompt_ids(args, engine)
        if len(ids) >= engine.max_model_len:  # fail before printing anything else
            engine.add_request("check", ids, params)
        if not args.json:
            print(engine.summary(), file=sys.stderr)
        t0 = time.perf_counter()
        out = engine.generate([ids], params)[0]
        elapsed = time.perf_counter() - t0
        if args.json:
            stats = {
                "prompt_tokens": out.num_prompt_tokens,
                "completion_tokens": out.num_output_tokens,
                "finish_reason": out.finish_reason,
                "seconds": round(elapsed, 4),
                "expert": engine.buffer.stats.summary(),
            }
            print(json.dumps({"text": out.text, "token_ids": out.output_token_ids, "stats": stats}))
        else:
            print(out.text)
    return 0


def make_recorder(path: str, cfg):
    """A tracer recorder writing one JSON line per finished request to ``path``."""
    from tracer.recorder import RequestRecorder
    from tracer.trace_file import TraceWriter

    return RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, trace_writer=TraceWriter(path))
