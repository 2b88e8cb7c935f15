"""``moeserve --version``, and ``--help`` of every (sub)command shows its options' defaults."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from moeserve import __version__
from moeserve.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moeserve {__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", __version__)


def test_every_help_shows_defaults() -> None:
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 10  # moeserve, serve, bench decode, trace import, ...
    shown = 0
    for parser in parsers:
        parser.format_help()  # every help renders
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or not action.help or action.default in (None, False):
                continue
            if action.default is argparse.SUPPRESS:
                continue
            text = formatter._expand_help(action)  # the text --help prints for this option
            assert "default" in text, (parser.prog, action.option_strings, text)
            assert text.count("(default:") <= 1, text  # never twice when the help already names it
            shown += 1
    assert shown > 50
