"""Write the policy grid's table (``tools/policy_grid.py``'s JSON files) into docs/results.md.

One row per (link, batch, buffer): ``eam`` and on-demand+LRU TPOT, median [min, max] over the
repeats; their paired ratio as ``bench policies`` computed it (``tpot_vs_on_demand`` of the eam
row, :mod:`moeserve.bench.policy_summary`: per round eam / on-demand, median [min, max]); the
share of measured decode steps the eam trial ran with prefetching on, and the per-arm shares where
the JSON has them (``arm_shares``); and issue #15's verdict on the ratio target
(:data:`~moeserve.bench.policy_summary.TPOT_RATIO_TARGET`, 1.02), see :func:`verdict`. A grid
point or buffer without a file or row is a ``missing`` row, never dropped. Beside the figures:
each point's workload, repeats, load averages and wall time.

The block between ``<!-- BEGIN policy-grid -->`` and ``<!-- END policy-grid -->`` is replaced,
or created just after ``<!-- END policies -->`` (at the end of the file when that marker is
absent). Every figure comes from the JSON files::

    python tools/update_policy_grid_docs.py [--dir runs/bench/grid] [--doc docs/results.md]

With ``--keep-previous NOTE`` the current block's count and table (an earlier output of this
tool) are first moved between ``<!-- BEGIN policy-grid-previous -->`` and ``<!-- END
policy-grid-previous -->``, just after the new block, headed by ``NOTE`` (e.g. the commit they
were measured at), so old and new rows stand side by side.

Exits 2 when ``--dir`` holds no point of the grid (the doc is left as it is), or when
``--keep-previous`` finds no block to keep.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from policy_grid import BATCHES, FRACTIONS, LINKS, OUT, ROOT, link_text, point_file  # noqa: E402

from moeserve.bench.policy_summary import BASELINE, DEFAULT, TPOT_RATIO_TARGET  # noqa: E402
from moeserve.bench.render import fmt_key  # noqa: E402

BEGIN, END = "<!-- BEGIN policy-grid -->", "<!-- END policy-grid -->"
PREV_BEGIN, PREV_END = "<!-- BEGIN policy-grid-previous -->", "<!-- END policy-grid-previous -->"
AFTER = "<!-- END policies -->"
VERDICTS = ("met", "within noise", "not met", "missing")


def verdict(ratio: float, ratio_max: float, bound: float = TPOT_RATIO_TARGET) -> str:
    """Issue #15's target on the paired TPOT ratio eam / on-demand+LRU: "met" when the slowest
    round's ratio is at most ``bound``, "within noise" when only the median is, else "not met"
    (the median above ``bound``)."""
    if ratio_max <= bound:
        return "met"
    return "within noise" if ratio <= bound else "not met"


def _share(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _arms(shares: dict[str, float] | None) -> str:
    return ", ".join(f"{arm} {v:.2f}" for arm, v in sorted(shares.items())) if shares else ""


def _row(link: float, batch: int, fraction: float, data: dict | None) -> tuple[list[str], str]:
    """One table row and its verdict; "missing" when the point or one of its two rows is absent."""
    head = [link_text(link), str(batch), f"{fraction:.0%}"]
    rows = data["results"] if data else []
    get = lambda p: next(  # noqa: E731
        (r for r in rows if abs(r["buffer_fraction"] - fraction) < 1e-9 and r["policy"] == p), None
    )
    eam, base = get(DEFAULT), get(BASELINE)
    if eam is None or base is None or eam.get("tpot_vs_on_demand") is None:
        what = "no file" if data is None else f"no {DEFAULT if eam is None else BASELINE} row"
        return head + [f"missing ({what})"] + [""] * 5 + ["missing"], "missing"
    v = verdict(eam["tpot_vs_on_demand"], eam["tpot_vs_on_demand_max"])
    return head + [
        f"{base['buffer_slots']}",
        fmt_key(eam, "tpot_ms"),
        fmt_key(base, "tpot_ms"),
        fmt_key(eam, "tpot_vs_on_demand", "{:.3f}"),
        _share(eam.get("prefetch_on_share")),
        _arms(eam.get("arm_shares")),
        v,
    ], v


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _load(x: list[float] | None) -> str:
    return ", ".join(str(v) for v in x) if x else "n/a"


def _settings(points: dict[tuple[float, int], dict | None]) -> tuple[str, str]:
    """Per point: workload, repeats, load averages and wall time; and the settings every point
    shares (or the keys in which they differ)."""
    rows, found = [], [d for d in points.values() if d]
    for (link, batch), d in points.items():
        if d is None:
            rows.append([link_text(link), str(batch)] + [""] * 7 + ["missing"])
            continue
        s = d["settings"]
        workload = [str(s[k]) for k in ("warm_prompts", "eval_prompts", "new_tokens", "repeats")]
        loads = [_load(s.get("load_avg_before")), _load(s.get("load_avg_after"))]
        rows.append(
            [link_text(link), str(batch), str(len(s["tasks"])), *workload, *loads, f"{s['wall_s']:.0f}"]
        )
    header = ["link GB/s", "batch", "tasks", "warm prompts", "eval prompts", "new tokens", "repeats",
              "load avg before (1, 5, 15 min)", "load avg after", "wall s"]  # fmt: skip
    # per point by design: the prompts scale with the batch (policy_grid.py --min-batches)
    per_point = {
        "batch",
        "link_gbps",
        "load_avg_before",
        "load_avg_after",
        "wall_s",
        "warm_prompts",
        "eval_prompts",
    }
    shown = {"tasks", "warm_prompts", "eval_prompts", "new_tokens", "repeats"}  # in the table
    keys = [k for k in found[0]["settings"] if k not in per_point]
    same = [k for k in keys if all(d["settings"].get(k) == found[0]["settings"][k] for d in found)]
    shared = ", ".join(f"`{k}={found[0]['settings'][k]}`" for k in same if k not in shown)
    differ = [k for k in keys if k not in same]
    if differ:
        shared += "; **the points differ in** " + ", ".join(f"`{k}`" for k in differ)
    return _table(header, rows), shared


def render(
    points: dict[tuple[float, int], dict | None],
    fractions: list[float],
    command: str = "python tools/update_policy_grid_docs.py",
) -> str:
    """The marked block for ``points`` ((link, batch) -> the point's JSON, None where absent), rows
    in the order of ``points`` then ``fractions``; ``command`` is the line shown as the one that
    wrote it. Raises ValueError when every point is absent."""
    found = [d for d in points.values() if d]
    if not found:
        raise ValueError("no point of the grid has a JSON file")
    header = ["link GB/s", "batch", "buffer", "slots", "eam TPOT ms", "on-demand+lru TPOT ms",
              "eam / on-demand (paired)", "prefetch on", "arm shares", "verdict"]  # fmt: skip
    rows, counts = [], dict.fromkeys(VERDICTS, 0)
    for (link, batch), d in points.items():
        for f in fractions:
            row, v = _row(link, batch, f, d)
            rows.append(row)
            counts[v] += 1
    if not any(r[8] for r in rows):
        header, rows = header[:8] + header[9:], [r[:8] + r[9:] for r in rows]  # no arm shares recorded
    settings, shared = _settings(points)
    grid = [d.get("grid", {}) for d in found]
    tools = dict.fromkeys(g.get("tool", "python tools/policy_grid.py") for g in grid)  # each run, once
    one = f"\n\nOne point's command: `{grid[0]['command']}`." if "command" in grid[0] else ""
    count = ", ".join(f"{n} {v}" for v, n in counts.items())
    wall = sum(d["settings"]["wall_s"] for d in found)
    return f"""{BEGIN}
### `eam` against on-demand+LRU over issue #15's grid (`tools/policy_grid.py`)

Issue #15: `eam` must be no slower than on-demand+LRU beyond noise, TPOT ratio at most
{TPOT_RATIO_TARGET}, at every emulated link, buffer and batch size below. One `bench policies` run per
(link, batch) point, run one after another; each runs the two policies round-robin, and the ratio
is paired per round (median [min, max] over rounds). Verdict: **met** when the slowest round's
ratio is at most {TPOT_RATIO_TARGET}; **within noise** when only the median is; **not met** when the
median is above it. (`bench policies`' own verdict calls a row "not met" only when every round is
above {TPOT_RATIO_TARGET}.) "prefetch on": the share of measured decode steps the eam trial ran
with prefetching on. Commands:

```bash
{chr(10).join(tools)}
{command}   # writes this block
```{one}

**{count}** ({len(rows)} rows).

{_table(header, rows)}

Settings per point ({wall / 60:.1f} minutes, {wall:.0f} s, of measurement in all, on this shared 2-core host;
a point's warm and eval prompts fill at least `tools/policy_grid.py --min-batches` batches each):

{settings}

Shared by every point: {shared}.
{END}
"""


def _place(text: str, block: str, begin: str, end: str, after: str) -> str:
    """``text`` with the block between ``begin`` and ``end`` replaced by ``block``, or inserted
    after the ``after`` line (appended when ``after`` is absent too)."""
    if begin in text:
        return re.sub(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", lambda _: block, text, flags=re.S)
    if after in text:
        at = text.index(after) + len(after)
        at = at + 1 if text[at : at + 1] == "\n" else at
        return text[:at] + "\n" + block + text[at:]
    return text.rstrip() + "\n\n" + block


def write_block(text: str, block: str) -> str:
    """``text`` with the policy-grid block replaced by ``block``, or inserted after the
    ``<!-- END policies -->`` line (appended when that marker is absent)."""
    return _place(text, block, BEGIN, END, AFTER)


def _is_count(line: str) -> bool:
    """Whether ``line`` is a block's verdict count (``**24 met, ...** (36 rows).``)."""
    return line.startswith("**") and "rows)" in line


def previous_block(text: str, note: str) -> str | None:
    """The previous-figures block: ``note``, then the count line and the verdict table of the
    policy-grid block in ``text`` as they stand; None without such a block."""
    m = re.search(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, flags=re.S)
    if m is None:
        return None
    lines = m.group(1).splitlines()
    count = next((i for i, line in enumerate(lines) if _is_count(line)), None)
    if count is None:
        return None
    table = []
    for line in lines[count + 1 :]:
        if line.startswith("|"):
            table.append(line)
        elif table:  # the table ended
            break
    body = "\n".join([lines[count], "", *table])
    return f"{PREV_BEGIN}\n{note}\n\n{body}\n{PREV_END}\n"


def write_previous(text: str, previous: str) -> str:
    """``text`` with the previous-figures block replaced by ``previous``, or inserted right after
    the policy-grid block."""
    return _place(text, previous, PREV_BEGIN, PREV_END, END)


def load_points(folder: Path, links: list[float], batches: list[int]) -> dict[tuple[float, int], dict | None]:
    """(link, batch) -> the point's JSON, None where its file is absent, in grid order."""
    out = {}
    for link in links:
        for batch in batches:
            path = point_file(folder, link, batch)
            out[(link, batch)] = json.loads(path.read_text()) if path.exists() else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=ROOT / OUT, help=f"the points' JSON (default: {OUT})")
    p.add_argument("--doc", type=Path, default=ROOT / "docs/results.md")
    p.add_argument("--links", default=",".join(f"{g:g}" for g in LINKS), help="expected links, GB/s")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="expected batch sizes")
    p.add_argument("--fractions", default=FRACTIONS, help="expected buffer sizes")
    p.add_argument(
        "--keep-previous",
        metavar="NOTE",
        help="keep the current table beside the new one, headed by NOTE (e.g. the commit it was measured at)",
    )
    args = p.parse_args(argv)
    links, batches = [float(x) for x in args.links.split(",")], [int(x) for x in args.batches.split(",")]
    points = load_points(args.dir, links, batches)
    try:
        given = list(sys.argv[1:] if argv is None else argv)
        if "--keep-previous" in given:  # the note is not part of the command that wrote the table
            i = given.index("--keep-previous")
            del given[i : i + 2]
        given = [a for a in given if not a.startswith("--keep-previous=")]
        shown = " ".join(["python tools/update_policy_grid_docs.py", *given])
        block = render(points, [float(x) for x in args.fractions.split(",")], shown)
    except ValueError as exc:
        print(f"update_policy_grid_docs: {args.dir}: {exc}; {args.doc} left as it is", file=sys.stderr)
        return 2
    text = args.doc.read_text()
    previous = None if args.keep_previous is None else previous_block(text, args.keep_previous)
    if args.keep_previous is not None and previous is None:
        print(
            f"update_policy_grid_docs: {args.doc}: no policy-grid table to keep; left as it is",
            file=sys.stderr,
        )
        return 2
    text = write_block(text, block)
    if previous is not None:
        text = write_previous(text, previous)
    args.doc.write_text(text)
    print(next(line for line in block.splitlines() if _is_count(line)))
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
