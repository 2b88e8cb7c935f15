"""``moeserve`` entry point: builds the argument parser from the subcommand modules.

Each module in :data:`COMMAND_MODULES` exposes ``register(subparsers)``, which adds its
subcommand(s) and sets ``func`` on the parsed namespace. Modules are imported lazily by name so a
broken optional dependency of one subcommand never breaks the others.

User errors (:class:`moe_runtime.errors.MoeServeError`, :class:`clients.errors.ClientError`, and
argparse's bad flags or values) print one line and exit with status 2. Every (sub)command's
``--help`` shows option defaults (:class:`HelpFormatter`); ``moeserve --version`` prints the
installed version.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, NoReturn

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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already speaks of its default,
    or the default says nothing (``None``, ``False`` of a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose default formatter is :class:`HelpFormatter`; the subcommand
    parsers are made of this class too (``add_subparsers`` uses the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """A bad flag or value: one line naming it (``moeserve: error: argument --x: ...``) and a
        pointer to ``--help`` on stderr, exit status 2 (argparse would print the whole usage)."""
        self.exit(2, f"moeserve: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from moeserve import __version__

    parser = Parser(
        prog="moeserve",
        description="Serve Mixture-of-Experts models with experts offloaded to host memory.",
    )
    parser.add_argument("--version", action="version", version=f"moeserve {__version__}")
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad flag (already reported on stderr)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except (MoeServeError, ClientError, TracerError) as exc:
        print(f"moeserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
