"""Rich tables never cut numbers: piped consoles keep a table's natural width, narrow ones fold."""

from __future__ import annotations

import io
import subprocess
import sys

from richconsole import PIPE_WIDTH, Table, make_console

NUMBERS = [f"{i}{i}{i}.{i}{i}{i}{i}{i}{i}" for i in range(1, 10)]


def _wide_table() -> Table:
    table = Table(*[f"column with a long header {i}" for i in range(len(NUMBERS))], title="wide")
    table.add_row(*NUMBERS)
    return table


def test_piped_console_prints_every_number_whole() -> None:
    buf = io.StringIO()
    console = make_console(file=buf)
    assert not console.is_terminal and console.width == PIPE_WIDTH
    console.print(_wide_table())
    text = buf.getvalue()
    assert all(n in text for n in NUMBERS) and "…" not in text
    assert max(len(line) for line in text.splitlines()) > 80  # wider than rich's piped default


def test_narrow_console_folds_instead_of_ellipsising() -> None:
    buf = io.StringIO()
    make_console(file=buf, width=60).print(_wide_table())
    text = buf.getvalue()
    assert "…" not in text
    digits = "".join(ch for ch in text if ch.isdigit() or ch == ".")
    for n in NUMBERS:  # folded cells keep their digits, in order, on the following lines
        assert n.replace(".", "")[:3] in digits.replace(".", "")


def test_stdout_pipe_through_a_subprocess() -> None:
    code = (
        "from richconsole import Table, make_console\n"
        f"t = Table(*['header number {{}}'.format(i) for i in range(9)])\nt.add_row(*{NUMBERS!r})\n"
        "make_console().print(t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert all(n in out.stdout for n in NUMBERS) and "…" not in out.stdout
