"""Settings of a replay run and the command-line flags that fill them (shared by replay and sweep)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.errors import ClientError
from clients.prompts import DEFAULT_CHARS_PER_TOKEN

#: Context length assumed when neither ``--max-context`` nor the server's ``/v1/models``
#: (``max_model_len``, an extension that not every OpenAI-compatible server sends) states one.
DEFAULT_MAX_CONTEXT = 2048
#: Seconds the clients wait for the server's ``/health`` to answer 200 before giving up.
DEFAULT_WAIT_S = 60.0


@dataclass(slots=True)
class ReplayConfig:
    """One replay run.

    Attributes:
        url: server base URL; the only address the client ever sends to.
        prompts: prompt JSONL (``dataset``, ``task``, ``prompt`` per line).
        trace: Azure trace CSV; ``None`` = Poisson arrivals at ``rps``.
        rps: target average rate, requests/s (trace: time-scaled to it; else Poisson).
        speedup: trace time divided by this (exclusive with ``rps``).
        trace_offset_s: skip the trace's first this many seconds (trace time, before scaling).
        duration_s: only arrivals in the first this many seconds (after scaling).
        max_requests: at most this many requests.
        max_tokens_cap: ``max_tokens`` = min(trace ``GeneratedTokens``, this); the value itself
            without a trace.
        max_context: prompt + output tokens stay within this; ``None`` = the server's
            ``max_model_len`` from ``/v1/models``, or :data:`DEFAULT_MAX_CONTEXT` (with a warning)
            when the server does not state one.
        seed: seeds prompt choice (and Poisson gaps).
        out: folder for ``requests.jsonl``, ``summary.json``, ``summary.txt`` and the scrapes.
        slo_tpot_ms: TPOT service-level objective for goodput, milliseconds.
        model: ``model`` field of requests, one of the ids ``/v1/models`` lists; ``None`` = the
            one model it lists (several: the run refuses to guess).
        tokenizer: ``tokenizer.json`` (or a folder with one) to measure prompt lengths.
        chars_per_token: a fixed length estimate instead; ``None`` = the server's own tokenizer
            through ``/tokenize``, else a calibration probe (``clients/sizing.py``).
        timeout_s: longest wait for the next byte of an answer, seconds.
        ignore_eos: send ``ignore_eos: true`` so outputs run to ``max_tokens`` (server extension).
        progress: show a progress bar.
        wait_s: how long to wait for the server's ``/health`` to answer 200 before the run starts,
            seconds (``clients/ready.py``).
    """

    url: str
    prompts: Path
    trace: Path | None = None
    rps: float | None = None
    speedup: float | None = None
    trace_offset_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_tokens_cap: int = 256
    max_context: int | None = None
    seed: int = 0
    out: Path | None = None
    slo_tpot_ms: float | None = None
    model: str | None = None
    tokenizer: Path | None = None
    chars_per_token: float | None = None
    timeout_s: float = 300.0
    ignore_eos: bool = False
    progress: bool = True
    wait_s: float = DEFAULT_WAIT_S

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ClientError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.rps is not None and self.speedup is not None:
            raise ClientError("give --rps or --speedup, not both")
        if self.trace is None and self.rps is None:
            raise ClientError("without --trace, --rps is needed (Poisson arrivals)")
        for name in ("rps", "speedup", "duration_s", "slo_tpot_ms", "timeout_s", "chars_per_token"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ClientError(f"{flag} must be > 0, got {v}")
        for name in ("max_requests", "max_tokens_cap", "max_context"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ClientError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.wait_s < 0:
            raise ClientError(f"--wait-s must be >= 0, got {self.wait_s}")
        if self.trace_offset_s < 0:
            raise ClientError(f"--trace-offset must be >= 0, got {self.trace_offset_s}")
        if self.out is None:
            self.out = Path("runs") / time.strftime("replay-%Y%m%d-%H%M%S")

    def settings(self) -> dict[str, Any]:
        """The settings printed beside the figures and stored in ``summary.json``."""
        return {
            "url": self.url,
            "trace": self.trace.name if self.trace else "poisson",
            "prompts": self.prompts.name,
            "rps": self.rps,
            "speedup": self.speedup,
            "trace_offset_s": self.trace_offset_s,
            "duration_s": self.duration_s,
            "max_requests": self.max_requests,
            "max_tokens_cap": self.max_tokens_cap,
            "max_context": self.max_context,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }


def add_replay_args(p: argparse.ArgumentParser, with_rate: bool = True) -> None:
    """Add the replay flags (``with_rate=False`` leaves out ``--rps``/``--speedup``/``--out``)."""
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--prompts", type=Path, required=True, metavar="JSONL", help="prompt JSONL ({dataset, task, prompt})"
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="CSV",
        help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens); default: Poisson",
    )
    if with_rate:
        rate = p.add_mutually_exclusive_group()
        rate.add_argument(
            "--rps", type=float, default=None, metavar="R", help="target average rate, requests/s"
        )
        rate.add_argument(
            "--speedup", type=float, default=None, metavar="S", help="divide trace time by this"
        )
        p.add_argument(
            "--out",
            type=Path,
            default=None,
            metavar="DIR",
            help="output folder (default: runs/replay-<time>)",
        )
    p.add_argument(
        "--trace-offset",
        type=float,
        default=0.0,
        metavar="SEC",
        help="skip the trace's first SEC seconds (trace time)",
    )
    p.add_argument(
        "--duration", type=float, default=None, metavar="SEC", help="only arrivals in the first SEC seconds"
    )
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="at most N requests")
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        metavar="N",
        default=256,
        help="max_tokens = min(trace GeneratedTokens, N); N without a trace (default: 256)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        metavar="N",
        default=None,
        help=f"prompt + output tokens limit (default: the server's max_model_len from /v1/models; "
        f"{DEFAULT_MAX_CONTEXT} when the server does not state one)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of prompt choice and Poisson gaps")
    p.add_argument("--slo-tpot-ms", type=float, default=None, metavar="X", help="TPOT SLO for goodput, ms")
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="model name to send, one of those /v1/models lists (default: the one model it lists)",
    )
    p.add_argument(
        "--wait-s",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="SEC",
        help="wait up to SEC seconds for the server's /health to answer 200 before starting "
        f"(default: {DEFAULT_WAIT_S:g})",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        default=None,
        help="tokenizer.json (or checkpoint folder) to size prompts; default: the server's /tokenize, "
        "else its chars/token measured with one probe request",
    )
    p.add_argument(
        "--chars-per-token",
        type=float,
        default=None,
        metavar="X",
        help=f"size prompts at X characters per token instead (the fallback when the server cannot "
        f"be measured is {DEFAULT_CHARS_PER_TOKEN})",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, metavar="SEC", help="longest wait for the next byte, s"
    )
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to run to max_tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace, **overrides: Any) -> ReplayConfig:
    """Build a :class:`ReplayConfig` from parsed flags (``overrides`` win)."""
    kw: dict[str, Any] = dict(
        url=args.url,
        prompts=args.prompts,
        trace=args.trace,
        rps=getattr(args, "rps", None),
        speedup=getattr(args, "speedup", None),
        trace_offset_s=args.trace_offset,
        duration_s=args.duration,
        max_requests=args.max_requests,
        max_tokens_cap=args.max_tokens_cap,
        max_context=args.max_context,
        seed=args.seed,
        out=getattr(args, "out", None),
        slo_tpot_ms=args.slo_tpot_ms,
        model=args.model,
        tokenizer=args.tokenizer,
        chars_per_token=args.chars_per_token,
        timeout_s=args.timeout,
        ignore_eos=args.ignore_eos,
        progress=not args.no_progress,
        wait_s=args.wait_s,
    )
    kw.update(overrides)
    return ReplayConfig(**kw)
