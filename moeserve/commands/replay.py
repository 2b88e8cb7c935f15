"""``moeserve replay``: replay Azure-trace (or Poisson) arrivals against a running server over HTTP.

The client side of MoE-Infinity §7.1: prompts drawn uniformly across tasks, arrivals from the
Azure LLM inference trace scaled to ``--rps`` (or ``--speedup``). Writes ``requests.jsonl``,
``summary.json`` and ``summary.txt`` to ``--out``. See :mod:`clients.replay`.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from clients.options import add_replay_args

    p = sub.add_parser(
        "replay",
        help="replay trace arrivals against a running OpenAI-compatible server",
        description="Send streaming /v1/completions at trace (or Poisson) arrival times to --url, "
        "then print latency percentiles, throughput, goodput and the server's buffer hit rate.",
    )
    add_replay_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from clients.options import config_from_args
    from clients.replay import replay

    summary = replay(config_from_args(args))
    return 0 if summary.succeeded > 0 else 1
