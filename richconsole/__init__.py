"""Rich output that never cuts a number: one console factory and one table class for every report.

A leaf package (imports rich only), so ``tracer``, ``moe_runtime``, ``clients`` and ``moeserve`` can
all use it without breaking the one-way dependencies of docs/architecture.md.

Rich sizes a table to the console's width. When output goes to a pipe or a file, a plain
``Console()`` takes 80 columns, and a wider table gets its cells wrapped or ellipsised
(``12.3…``): the figures a user greps or pastes are lost. So:

* :func:`make_console` gives a console that keeps the terminal's width on a terminal and is
  :data:`PIPE_WIDTH` columns wide anywhere else (pipes, files, ``StringIO``), so tables keep their
  natural width and long lines are not wrapped;
* :class:`Table` folds a cell that still does not fit (on a narrow terminal) onto further lines
  instead of ellipsising it, so every digit is printed.
"""

from __future__ import annotations

from typing import IO, Any

from rich.console import Console
from rich.table import Table as RichTable

#: Width (columns) of a console that is not a terminal: wider than any report's table.
PIPE_WIDTH = 400


def make_console(*, stderr: bool = False, file: IO[str] | None = None, **kwargs: Any) -> Console:
    """A rich ``Console`` on stdout (``stderr=True``: stderr; or ``file``); extra ``kwargs``
    (``record=True``, ...) go to ``Console``. Width: the terminal's, else :data:`PIPE_WIDTH`
    (an explicit ``width=`` is kept)."""
    console = Console(stderr=stderr, file=file, **kwargs)
    if "width" not in kwargs and not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


class Table(RichTable):
    """``rich.table.Table`` whose columns fold overflowing cells (``overflow="fold"``) by default
    instead of ellipsising them; headers passed to the constructor get the same default."""

    def add_column(self, *args: Any, overflow: Any = "fold", **kwargs: Any) -> None:
        super().add_column(*args, overflow=overflow, **kwargs)
