"""``moeserve bench sweep``: replay at several request rates; latency and hit rate vs RPS.

The shape of MoE-Infinity's Figure 9 (decode latency, TPOT, as the offered RPS grows) plus the
buffer hit rate per rate from the server's ``/metrics``. Every rate is one full replay run against
the same running server (its cache and EAMC carry over from rate to rate, as on a live service),
with a pause between runs so the previous rate's requests have drained. Each run waits for the
server's ``/health`` (``--wait-s``) and reads the model from ``/v1/models`` as ``moeserve replay``
does, and says why a rate offered differs from the one asked for.

Writes ``sweep.json`` (one summary per rate), ``sweep-latency.png`` and ``sweep-hitrate.png`` to
``--out``, and each rate's replay files to ``--out/rps-<rate>/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from clients.errors import ClientError
from clients.options import add_replay_args, config_from_args
from clients.plots import plot_sweep
from clients.replay import run_async
from clients.report import Summary
from richconsole import make_console


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]``.

    Raises:
        ClientError: a value that is not a positive number, or none at all.
    """
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ClientError(f"--rates: {text!r} is not a comma-separated list of numbers") from None
    if not rates or any(not r > 0 for r in rates):
        raise ClientError(f"--rates: need positive rates, got {text!r}")
    return rates


def sweep_rows(summaries: list[Summary]) -> list[dict[str, Any]]:
    """One flat row per rate: offered and sent rate, throughput, latency percentiles (ms), hit rate,
    and why the offered rate differs from ``rps`` (``rate_note``, ``None`` within 10%)."""
    rows = []
    for s in summaries:
        sv = s.server
        rows.append(
            {
                "rps": s.settings["rps"],
                "offered_rps": s.offered_rps,
                "sent_rps": s.sent_rps,
                "throughput_rps": s.throughput_rps,
                "output_tokens_per_s": s.output_tokens_per_s,
                "goodput_rps": s.goodput_rps,
                "requests": s.requests,
                "failed": s.failed,
                **{
                    f"{m}_{p}_ms": getattr(getattr(s, m), f"{p}_ms")
                    for m in ("ttft", "tpot", "e2e")
                    for p in ("p50", "p90", "p99")
                },
                "hit_rate": sv.hit_rate if sv else None,
                "blocking_s": sv.blocking_s if sv else None,
                "rate_note": s.rate_note,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    rates = parse_rates(args.rates)
    out = args.out or Path("runs") / time.strftime("sweep-%Y%m%d-%H%M%S")
    console = make_console(stderr=True)
    summaries: list[Summary] = []
    for i, rps in enumerate(rates):
        if i and args.pause > 0:
            time.sleep(args.pause)
        console.rule(f"rate {rps:g} req/s")
        cfg = config_from_args(args, rps=rps, out=out / f"rps-{rps:g}")
        summaries.append(asyncio.run(run_async(cfg, console)))
    rows = sweep_rows(summaries)
    title = f"{args.trace.name if args.trace else 'poisson'}, {args.url}, duration {args.duration} s"
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "settings": summaries[0].settings | {"rps": rates},
        "rows": rows,
        "summaries": [asdict(s) for s in summaries],
    }
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    pngs = plot_sweep(rows, out, title)
    if args.json:
        json.dump({"settings": result["settings"], "rows": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    console.print(f"sweep: {out / 'sweep.json'}  plots: {', '.join(str(p) for p in pngs)}")
    return 0


def register_bench(benches: argparse._SubParsersAction) -> None:
    p = benches.add_parser(
        "sweep",
        help="replay at several request rates; latency and hit rate vs RPS (PNG + JSON)",
        description="Run `moeserve replay` once per --rates value against a running server and plot "
        "TPOT/TTFT percentiles and the expert buffer hit rate against the request rate.",
    )
    add_replay_args(p, with_rate=False)
    p.add_argument(
        "--rates",
        required=True,
        metavar="R1,R2,...",
        help="comma-separated request rates, req/s, e.g. 0.5,1,2",
    )
    p.add_argument("--pause", type=float, default=2.0, help="seconds between rates (default: 2)")
    p.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="output folder (default: runs/sweep-<time>)"
    )
    p.add_argument("--json", action="store_true", help="print the per-rate rows as JSON on stdout")
    p.set_defaults(func=run)
