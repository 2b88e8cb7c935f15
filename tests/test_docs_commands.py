"""Every command in the docs runs as written, from a fresh clone's point of view.

The fenced shell blocks of README.md and docs/*.md are read: every line of a ``bash``/``sh`` block,
and the ``$ ``-prompted lines of an untagged transcript block (the lines after one, up to the next
prompt, are its documented output). For each ``moeserve`` or ``python`` command:

* ``moeserve ...`` is parsed by the real argument parser (:func:`moeserve.cli.build_parser`): every
  flag exists and every value parses; ``python -m MODULE`` / ``python FILE`` must name a module or
  file of the repository;
* every ``../shared/...`` path resolves next to the repository root (``MOESERVE_SHARED`` names
  another folder; without either, that check is skipped with a message);
* every output path (``--out``, ``--markdown``, ``> FILE`` ...) has a folder that exists in the
  repository, is created earlier in the block (``mkdir -p``), or is created by the command (proved
  by running it, or listed in :data:`CREATES_OUT` with the code that does it);
* the cheap commands are RUN, in order, in one copy of the repository's tracked files with
  ``../shared`` beside it (:data:`RUN`); ``--max-tokens`` is capped at 8 to keep the whole file
  under a minute. Transcript output of a run command must show the same numbers as the run.

Heavy commands (servers, benchmarks, simulations, multi-GB checkpoints) are parse-checked only,
each for the reason in :data:`PARSE_ONLY`. Known failures in docs owned by other work are
``xfail`` (strict) in :data:`KNOWN_BROKEN`, naming the doc and the fault.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moeserve.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_TAGS = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&"}
OUT_FLAGS = {"--out", "--markdown", "--card", "--record-trace"}
MAX_TOKENS_CAP = 8

#: Commands that are run: (subcommand words) -> why it is cheap.
RUN: dict[tuple[str, ...], str] = {
    ("--version",): "prints a string",
    ("generate",): "the bundled 27 MiB model, --max-tokens capped at 8",
    ("trace", "import"): "converts a few hundred tokens of routing log",
    ("trace", "stats"): "statistics of a small trace file",
    ("trace", "predict-eval"): "prediction quality on a few hundred tokens",
}

#: Commands parse-checked only: (subcommand words) -> why they are not run here.
PARSE_ONLY: dict[tuple[str, ...], str] = {
    ("serve",): "starts a server that runs until killed",
    ("replay",): "needs a running server and runs for minutes",
    ("bench",): "benchmarks take minutes",
    ("simulate",): "simulations of real-scale models take minutes",
    ("make-checkpoint",): "writes a checkpoint of a real model shape (GBs)",
    ("trace", "record"): "runs the model on dozens of prompts",
    ("train-tiny",): "trains a model",
}

#: Commands whose output folders the command itself creates, so a fresh clone needs no mkdir.
CREATES_OUT: dict[tuple[str, ...], str] = {
    ("replay",): "clients/replay.py write_outputs: out.mkdir(parents=True)",
    ("bench", "sweep"): "clients/sweep.py run: out.mkdir(parents=True)",
    ("make-checkpoint",): "moeserve/checkpoints/writer.py: out.mkdir(parents=True)",
    ("trace", "record"): "TraceWriter (tracer/trace_file.py): path.parent.mkdir(parents=True)",
    ("trace", "import"): "TraceWriter (tracer/trace_file.py): path.parent.mkdir(parents=True); also run here",
}

#: ``python -m`` modules whose ``--out`` folder the module itself creates.
PY_CREATES_OUT: dict[str, str] = {
    "moeserve.sim.calibrate": "moeserve/sim/calibrate.py main: args.out.mkdir(parents=True)",
}

#: (doc, substring of the command) -> the fault, for docs this change does not own; strict xfail.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}


@dataclass(slots=True)
class DocCommand:
    """One simple command of a doc block: its words, where it is, what the block did before it."""

    doc: str
    line: int
    argv: list[str]
    redirect: str | None = None
    made_dirs: set[str] = field(default_factory=set)
    output: str | None = None  # documented output of a transcript command
    input_from: str | None = None  # a file it reads that an earlier, not-run command writes

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{' '.join(self.argv[:3])}"


def _blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, tag, lines) of each fenced block."""
    out, tag, start, body = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        if tag is None and line.startswith("```"):
            tag, start, body = line[3:].strip(), i + 1, []
        elif tag is not None and line.startswith("```"):
            out.append((start, tag, body))
            tag = None
        elif tag is not None:
            body.append(line)
    return out


def _logical_lines(start: int, tag: str, lines: list[str]) -> list[tuple[int, str, str | None]]:
    """(line number, command text, documented output) of a block, continuations joined."""
    transcript = tag not in SHELL_TAGS
    out: list[tuple[int, str, str | None]] = []
    i = 0
    while i < len(lines):
        line, lineno = lines[i], start + i
        i += 1
        if transcript:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        output = None
        if transcript:
            j = i
            while j < len(lines) and not lines[j].startswith("$ "):
                j += 1
            output, i = "\n".join(lines[i:j]), j
        if line.strip() and not line.lstrip().startswith("#"):
            out.append((lineno, line, output))
    return out


def _split(line: str, env: dict[str, str]) -> list[tuple[list[str], str | None]]:
    """Simple commands of one shell line: (words with $VARS expanded, ``>`` target)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    cmds: list[tuple[list[str], str | None]] = [([], None)]
    words = list(lex)
    k = 0
    while k < len(words):
        w = words[k]
        if w in OPERATORS:
            cmds.append(([], None))
        elif w in (">", ">>") and k + 1 < len(words):
            cmds[-1] = (cmds[-1][0], words[k + 1])
            k += 1
        else:
            cmds[-1][0].append(re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), w))
        k += 1
    return [(argv, redirect) for argv, redirect in cmds if argv]


def collect() -> list[DocCommand]:
    found: list[DocCommand] = []
    for path in DOCS:
        doc = str(path.relative_to(REPO))
        not_written: set[str] = set()  # outputs of commands of this doc that are not run
        for start, tag, lines in _blocks(path.read_text(encoding="utf-8")):
            if tag and tag not in SHELL_TAGS:
                continue  # yaml, json, promql, python ...: not shell
            env: dict[str, str] = {}
            made: set[str] = set()
            for lineno, text, output in _logical_lines(start, tag, lines):
                for name, values in re.findall(r"\bfor (\w+) in ([^;]+);", text):
                    env[name] = values.split()[0]  # a loop's commands are checked for its first value
                for argv, redirect in _split(text, env):
                    if len(argv) == 1 and re.fullmatch(r"\w+=.*", argv[0]):
                        name, value = argv[0].split("=", 1)
                        env[name] = value
                        continue
                    if argv[:2] == ["/usr/bin/time", "-f"]:
                        argv = argv[3:]
                    if argv[0] == "mkdir":
                        made |= {a.rstrip("/") for a in argv[1:] if not a.startswith("-")}
                    cmd = DocCommand(doc, lineno, argv, redirect, set(made), output)
                    cmd.input_from = next((a for a in argv if a in not_written), None)
                    if not _will_run(cmd):
                        not_written |= set(_outputs(cmd))
                    found.append(cmd)
    return found


def _words(argv: list[str]) -> tuple[str, ...]:
    """The subcommand words of a moeserve command (``("trace", "import")``)."""
    return tuple(w for w in argv[1:3] if not w.startswith("-") or w == "--version")


def _lookup(table: dict[tuple[str, ...], str], argv: list[str]) -> str | None:
    words = _words(argv)
    for n in (2, 1):
        if words[:n] in table:
            return table[words[:n]]
    return None


def _shared_dir() -> Path | None:
    shared = Path(os.environ.get("MOESERVE_SHARED") or REPO.parent / "shared")
    return shared if shared.is_dir() else None


def _will_run(cmd: DocCommand) -> bool:
    if cmd.argv[0] != "moeserve" or _lookup(RUN, cmd.argv) is None:
        return False
    if _words(cmd.argv)[:1] == ("generate",) and "--model" in cmd.argv:
        return False  # a user's checkpoint or one a parse-only command writes
    if cmd.input_from is not None:
        return False  # its input is written by a parse-only command
    needs_shared = any(a.startswith("../shared/") for a in cmd.argv)
    return not needs_shared or _shared_dir() is not None


def _outputs(cmd: DocCommand) -> list[str]:
    outs = [cmd.argv[i + 1] for i, a in enumerate(cmd.argv[:-1]) if a in OUT_FLAGS]
    return outs + ([cmd.redirect] if cmd.redirect else [])


def test_no_command_writes_into_the_docs() -> None:
    """Running the documented commands removes no committed section of any doc: none writes into
    README.md or docs/ (an output flag or a redirection there); the docs' generated blocks are
    written by ``tools/docs.py`` alone, which never deletes one (tests/test_docs_blocks.py)."""
    writers = [
        f"{c.id} -> {out}"
        for c in COMMANDS
        for out in _outputs(c)
        if out == "README.md" or out.startswith(("docs/", "./docs/"))
    ]
    assert not writers, f"documented commands that write into the docs: {writers}"


#: Top-level folders whose paths the docs name in backticks.
NAMED_TOPS = ("moe_runtime/", "moeserve/", "tracer/", "server/", "clients/", "tools/", "tests/", "deploy/",
              "richconsole/", "docs/")  # fmt: skip


def test_named_files_exist() -> None:
    """Every repository path the docs name in backticks (``moe_runtime/prefetch/eam.py``) exists, so a
    file moved or split shows up here; placeholders (``docs/data/NAME.json``) are skipped."""
    missing = [
        f"{path.relative_to(REPO)}: {name}"
        for path in DOCS
        for name in re.findall(r"`([\w./-]+)`", path.read_text(encoding="utf-8"))
        if name.startswith(NAMED_TOPS) and not re.search(r"[A-Z]{3,}", name) and not (REPO / name).exists()
    ]
    assert not missing, f"the docs name files that do not exist: {missing}"


def test_command_blocks_are_tagged() -> None:
    """A block of commands without a shell tag or ``$`` prompts would escape the checks above:
    commands are tagged ``bash``, a synopsis with placeholders ``text``."""
    untagged = [
        f"{path.relative_to(REPO)}:{start}"
        for path in DOCS
        for start, tag, lines in _blocks(path.read_text(encoding="utf-8"))
        if not tag and lines and re.match(r"(moeserve|python) ", lines[0])
    ]
    assert not untagged, f"untagged command blocks (tag them bash, or text for a synopsis): {untagged}"


def _clone_files() -> list[str]:
    """The files a fresh clone has (tracked, plus new files not ignored: this change's own)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return [f.decode() for f in files if f]


CLONE_DIRS = {str(p) for f in _clone_files() for p in Path(f).parents}


COMMANDS = collect()
CHECKED = [c for c in COMMANDS if c.argv[0] in ("moeserve", "python") or c.argv[0].startswith("../shared/")]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A copy of the repository's tracked files (a fresh clone) with ``../shared`` beside it."""
    root = tmp_path_factory.mktemp("clone")
    for name in _clone_files():
        src, dst = REPO / name, root / "repo" / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    shared = _shared_dir()
    if shared is not None:
        (root / "shared").symlink_to(shared.resolve())
    return root / "repo"


def _marks(cmd: DocCommand) -> list[pytest.MarkDecorator]:
    for (doc, needle), why in KNOWN_BROKEN.items():
        if cmd.doc == doc and needle in " ".join(cmd.argv):
            return [pytest.mark.xfail(reason=f"{doc}: {why}", strict=True)]
    return []


def _numbers(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?", text)


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CHECKED])
def test_doc_command(cmd: DocCommand, workspace: Path, monkeypatch, capsys) -> None:
    argv = cmd.argv
    if argv[0] == "python":
        _check_python(argv)
    elif argv[0] == "moeserve":
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(argv[1:])
        except SystemExit as exc:  # --version and --help exit 0 after printing
            if exc.code not in (0, None):
                pytest.fail(f"{cmd.id}: the parser refuses it: {err.getvalue().strip()}")
        assert _lookup(RUN, argv) or _lookup(PARSE_ONLY, argv), f"{cmd.id}: add it to RUN or PARSE_ONLY"
    shared_paths = [a for a in argv if a.startswith("../shared/")]
    shared = _shared_dir()
    for p in shared_paths if shared is not None else []:
        assert (shared / p.removeprefix("../shared/")).exists(), f"{cmd.id}: {p} does not exist"
    for out in _outputs(cmd):
        parent = Path(out).parent
        ok = (
            parent.is_absolute()
            or (REPO / parent).is_dir()
            or any(str(parent) == d or str(parent).startswith(d + "/") for d in cmd.made_dirs)
            or _will_run(cmd)
            or (argv[0] == "moeserve" and _lookup(CREATES_OUT, argv) is not None and out != cmd.redirect)
            or (argv[:2] == ["python", "-m"] and argv[2] in PY_CREATES_OUT and out != cmd.redirect)
        )
        assert ok, f"{cmd.id}: the folder {parent}/ of {out} is neither in a fresh clone nor created"
    if _will_run(cmd):
        _run(cmd, workspace, monkeypatch, capsys)
    elif shared_paths and shared is None:
        unrun = " and the command not run" if argv[0] == "moeserve" and _lookup(RUN, argv) else ""
        pytest.skip(f"{cmd.id}: ../shared is absent (set MOESERVE_SHARED): its paths unchecked{unrun}")


def _check_python(argv: list[str]) -> None:
    if argv[1] == "-m":
        assert importlib.util.find_spec(argv[2]) is not None, f"no module {argv[2]}"
    else:
        assert (REPO / argv[1]).is_file(), f"no file {argv[1]}"


def _run(cmd: DocCommand, workspace: Path, monkeypatch, capsys) -> None:
    argv = list(cmd.argv[1:])
    for i, a in enumerate(argv[:-1]):
        if a == "--max-tokens":
            argv[i + 1] = str(min(int(argv[i + 1]), MAX_TOKENS_CAP))
    tmp = workspace.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    argv = [str(tmp) + a[4:] if a.startswith("/tmp/") else a for a in argv]
    monkeypatch.chdir(workspace)
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, f"{cmd.id}: exit {rc}: {err.strip()[-500:]}"
    for path in _outputs(cmd):
        assert (workspace / path.replace("/tmp/", str(tmp) + "/", 1)).exists(), f"{cmd.id}: wrote no {path}"
    if cmd.output and _words(cmd.argv) != ("generate",):
        want = _numbers(cmd.output.replace("/tmp/", ""))
        got = _numbers((out + err).replace(str(tmp) + "/", ""))
        assert got == want, f"{cmd.id}: the documented output is not this command's output"
