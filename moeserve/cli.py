"""``moeserve`` entry point: builds the argument parser from the subcommand modules.

Each module in :data:`COMMAND_MODULES` exposes ``register(subparsers)``, which adds its
subcommand(s) and sets ``func`` on the parsed namespace. Modules are imported lazily by name so a
broken optional dependency of one subcommand never breaks the others.

User errors (:class:`moe_runtime.errors.MoeServeError`, :class:`clients.errors.ClientError`) print one
line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "moeserve.commands.generate",
    "moeserve.commands.serve",
    "moeserve.commands.bench",
    "moeserve.commands.replay",
    "moeserve.commands.trace",
    "moeserve.commands.train_tiny",
    "moeserve.commands.make_checkpoint",
    "moeserve.commands.simulate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeserve",
        description="Serve Mixture-of-Experts models with experts offloaded to host memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from clients.errors import ClientError
    from moe_runtime.errors import MoeServeError
    from tracer.errors import TracerError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (MoeServeError, ClientError, TracerError) as exc:
        print(f"moeserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
