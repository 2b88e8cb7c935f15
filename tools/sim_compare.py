"""Before/after Markdown table of ``moeserve simulate --all-policies --json`` outputs.

Run ``python tools/sim_compare.py --before OLD.json ... --after NEW.json ... [--lookahead LA.json ...]``:
files are paired by (hardware, slots); each row is one policy with its TPOT before and after, the
ratio to the same run's on-demand+lru TPOT, and the share of the on-demand+lru -> oracle TPOT gap it
closes. ``--lookahead`` adds the ``eam`` row of runs with a modelled router lookahead. Every figure
comes from the files; nothing is typed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeserve.sim.report import gap_closed


def _load(path: str) -> tuple[tuple[str, int], dict, dict[str, dict]]:
    doc = json.loads(Path(path).read_text())
    st = doc["settings"]
    key = (st["hardware"].split(":")[0], int(st["slots"]))
    return key, st, {r["policy"]: r for r in doc["results"]}


def _gap(rows: dict[str, dict], tpot: float) -> str:
    base, oracle = rows.get("on-demand+lru"), rows.get("oracle")
    g = gap_closed(tpot, base["tpot_ms"], oracle["tpot_ms"]) if base and oracle else None
    return f"{100 * g:.0f}%" if g is not None else "-"


def render(before: list[str], after: list[str], lookahead: list[str]) -> str:
    """The table (Markdown) for the given JSON files."""
    old = {k: rows for k, _, rows in map(_load, before)}
    ahead = {k: (st, rows) for k, st, rows in map(_load, lookahead)}
    lines = [
        "| hardware | slots | policy | TPOT ms before | TPOT ms now | now / on-demand+lru | gap closed before "
        "| gap closed now | bytes vs oracle now |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, st, rows in sorted(map(_load, after)):
        base = rows["on-demand+lru"]["tpot_ms"]
        prev = old.get(key, {})
        extra = []
        if key in ahead:
            la_st, la_rows = ahead[key]
            row = dict(la_rows["eam"], policy=f"eam, lookahead p={la_st['lookahead_precision']}")
            extra.append((row, la_rows))
        for r, own in [(r, rows) for r in rows.values()] + extra:
            was = prev.get(r["policy"])
            bvo = r.get("bytes_vs_oracle")
            cells = [
                key[0],
                f"{key[1]} ({st['slots_share']})",
                r["policy"],
                f"{was['tpot_ms']:.1f}" if was else "-",
                f"{r['tpot_ms']:.1f}",
                f"{r['tpot_ms'] / base:.3f}",
                _gap(prev, was["tpot_ms"]) if was else "-",
                _gap(own, r["tpot_ms"]),
                f"{bvo:.2f}x" if bvo is not None else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/sim_compare.py", description=__doc__)
    p.add_argument("--before", nargs="+", required=True, help="simulate --json outputs of the old code")
    p.add_argument("--after", nargs="+", required=True, help="simulate --json outputs of the new code")
    p.add_argument("--lookahead", nargs="*", default=[], help="new runs with --lookahead-precision")
    args = p.parse_args(argv)
    print(render(args.before, args.after, args.lookahead))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
