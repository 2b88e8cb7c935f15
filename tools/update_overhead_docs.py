"""Run ``moeserve bench overhead`` and write its output into docs/simulator.md.

The block between ``<!-- BEGIN overhead -->`` and ``<!-- END overhead -->`` is the command's
own stdout (settings line, per-batch figures, budget verdicts), so the doc never holds a typed
figure. Extra arguments are passed to the command (e.g. ``--repeats 5``); the doc shows them.
"""

import re
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
doc = root / "docs/simulator.md"
args = sys.argv[1:]
out = subprocess.run(
    [sys.executable, "-m", "moeserve", "bench", "overhead", *args],
    cwd=root,
    capture_output=True,
    text=True,
    check=True,
).stdout.strip()
text = doc.read_text()
pattern = re.compile(
    r"(\$ moeserve bench overhead[^\n]*\n<!-- BEGIN overhead -->\n).*?(<!-- END overhead -->)", re.S
)
if not pattern.search(text):
    raise SystemExit(f"{doc}: no '$ moeserve bench overhead' block with BEGIN/END overhead markers")
shown = " ".join(["$ moeserve bench overhead", *args])
text = pattern.sub(lambda m: f"{shown}\n<!-- BEGIN overhead -->\n{out}\n{m.group(2)}", text)
doc.write_text(text)
print(f"wrote {doc.relative_to(root)}")
