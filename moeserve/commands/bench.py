"""``moeserve bench <name>``: benchmarks that ship with the package (``--json`` for machines).

Each module in :data:`BENCH_MODULES` exposes ``register_bench(subparsers)`` adding one benchmark.
"""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES: list[str] = [
    "moeserve.bench.decode",
    "moeserve.bench.policies",
    "moeserve.bench.lookahead",
    "moeserve.bench.experts",
    "moeserve.bench.overhead",
    "moeserve.bench.memory_split",
    "moeserve.bench.render",
    "clients.sweep",
    "moeserve.bench.eamc",
    "moeserve.bench.policy_ab",
    "moeserve.bench.quant_loss",
    "moeserve.bench.cpu_experts",
    "moeserve.bench.hybrid",
    "moeserve.bench.kv",
    "moeserve.bench.launches",
]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (decode, eamc, policies, sweep, ...)")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    for name in BENCH_MODULES:
        importlib.import_module(name).register_bench(benches)
