"""Run ``moeserve bench overhead`` and write its output into docs/simulator.md.

Two blocks, each the command's own stdout (settings line, per-batch figures, budget verdicts),
so the doc never holds a typed figure: between ``<!-- BEGIN overhead -->`` and ``<!-- END
overhead -->`` the command as given (the EAMC term weighed, as the runtime does), and between
``<!-- BEGIN overhead_always -->`` and ``<!-- END overhead_always -->`` the same with
``--eamc-term always`` (the term computed at every plan, as before it was weighed), side by
side. Extra arguments are passed to both runs (e.g. ``--repeats 5``); the doc shows them.
With ``--keep-previous NOTE`` the ``overhead`` block's current content is first moved between
``<!-- BEGIN overhead_previous -->`` and ``<!-- END overhead_previous -->`` (an earlier output of
this tool, kept beside the new one), headed by ``NOTE`` (e.g. the commit it was measured at).
"""

import re
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
doc = root / "docs/simulator.md"
args = sys.argv[1:]
if {"-h", "--help"} & set(args):  # not handed to the bench: its help would land in the doc
    raise SystemExit(__doc__)
previous_note = None
if "--keep-previous" in args:
    i = args.index("--keep-previous")
    if i + 1 >= len(args):
        raise SystemExit("--keep-previous needs a note (e.g. the commit the old figures were measured at)")
    previous_note = args[i + 1]
    del args[i : i + 2]
if "--eamc-term" in args:
    raise SystemExit("--eamc-term: this tool writes both settings itself")
text = doc.read_text()
if previous_note is not None:
    current = re.search(r"<!-- BEGIN overhead -->\n(.*?)<!-- END overhead -->", text, re.S)
    kept = re.compile(r"(<!-- BEGIN overhead_previous -->\n).*?(<!-- END overhead_previous -->)", re.S)
    if current is None or not kept.search(text):
        raise SystemExit(f"{doc}: --keep-previous needs the overhead and overhead_previous markers")
    text = kept.sub(lambda m: f"{m.group(1)}{previous_note}\n{current.group(1)}{m.group(2)}", text)
for block, extra in (("overhead", []), ("overhead_always", ["--eamc-term", "always"])):
    out = subprocess.run(
        [sys.executable, "-m", "moeserve", "bench", "overhead", *args, *extra],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pattern = re.compile(
        rf"(\$ moeserve bench overhead[^\n]*\n<!-- BEGIN {block} -->\n).*?(<!-- END {block} -->)", re.S
    )
    if not pattern.search(text):
        raise SystemExit(f"{doc}: no '$ moeserve bench overhead' block with BEGIN/END {block} markers")
    shown = " ".join(["$ moeserve bench overhead", *args, *extra])
    text = pattern.sub(lambda m, s=shown, o=out, b=block: f"{s}\n<!-- BEGIN {b} -->\n{o}\n{m.group(2)}", text)
doc.write_text(text)
print(f"wrote {doc.relative_to(root)}")
