"""Run ``moeserve bench policies`` over issue #15's grid: every emulated link and batch size, one JSON per point.

Issue #15 asks that ``eam`` (the default) be never slower than on-demand+LRU beyond noise (TPOT
ratio at most 1.02) with the emulated link at 0.5, 4 and 32 GB/s and off, buffers of 10, 25 and
50% of the experts, at batch 1, 4 and 16. ``bench policies`` measures one (link, batch) point per
run; this tool runs it once per point, sequentially (one subprocess at a time, so points do not
compete for the CPU), with only the two policies the target compares::

    python tools/policy_grid.py                     # the full grid into runs/bench/grid/
    python tools/policy_grid.py --links 4 --batches 4 --fractions 0.5 --repeats 3   # one point
    python tools/update_policy_grid_docs.py         # the table, into docs/results.md

Each point's ``--json`` output is saved as ``DIR/link<G>-batch<B>.json`` (``linkoff`` for no
link) with a ``grid`` key added: the exact ``bench policies`` command and this tool's command line.
A point whose file exists is skipped (resume after an interruption) unless ``--force``; a file
written by a different command is an error rather than a silent mix of workloads. A file is
written only when its run succeeded (through a temporary name), so an interrupted point reruns.

Workload: ``--tasks 8 --eval 2`` gives 16 eval prompts, so batch 4 fills four batches and
batch 1 sixteen; ``--warm 2`` prompts per task warm the EAMC and the eam trial, and
``--new-tokens 16`` tokens per request keep the grid short. ``--min-batches 4`` raises the warm
and the eval prompts per task of a point to fill at least that many batches each
(:func:`prompts_per_task`): at batch 16, 8 warm and 8 eval prompts per task (``bench policies``
draws, seeded, among the tasks with that many prompts, so the batch-16 points run other tasks than
batch 1 and 4; the grid doc names the difference). Before it, a batch-16
point warmed on one batch of 15 decode steps and measured one more, while the eam trial measures
its arms in pairs of 4-step windows (``moe_runtime.prefetch.trial.ModeTrial``: six windows and
their settling steps, about 45 decode steps, before its first choice), so that point measured the
trial's first exploration (prefetching on in 40-47% of its steps wherever the link left
prefetching unbarred) where batch 1 and 4, warmed on 16 and 4 batches, measured its choice. Flags this tool does not know
(``--model``, ``--seed``, ...) are passed to ``bench policies`` as they are. Exits 1 when a point
failed (the others still run), 2 on bad flags or a saved file from another command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Issue #15's grid: emulated link in GB/s (0 = no link) and batch sizes.
LINKS = (0.5, 4.0, 32.0, 0.0)
BATCHES = (1, 4, 16)
FRACTIONS = "0.1,0.25,0.5"
POLICIES = "on-demand+lru,eam"
OUT = Path("runs/bench/grid")


def link_text(link: float) -> str:
    """``0.5``, ``4``, ``32``, or ``off`` for 0 (no emulated link)."""
    return "off" if link == 0 else f"{link:g}"


def point_file(out: Path, link: float, batch: int) -> Path:
    """Where the point (``link`` GB/s, ``batch``) is saved: ``out/link<G>-batch<B>.json``."""
    return out / f"link{link_text(link)}-batch{batch}.json"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The tool's flags and the unknown ones, which go to ``bench policies`` as they are."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument(
        "--links", type=floats, default=list(LINKS), help="GB/s, 0 = no link (default: 0.5,4,32,0)"
    )
    p.add_argument("--batches", type=ints, default=list(BATCHES), help="batch sizes (default: 1,4,16)")
    p.add_argument("--fractions", default=FRACTIONS, help=f"buffer sizes (default: {FRACTIONS})")
    p.add_argument("--policies", default=POLICIES, help=f"(default: {POLICIES})")
    p.add_argument("--repeats", type=int, default=3, help="rounds per point, >= 3 (default: 3)")
    p.add_argument("--tasks", type=int, default=8, help="tasks drawn (default: 8)")
    p.add_argument("--warm", type=int, default=2, help="warm prompts per task (default: 2)")
    p.add_argument("--eval", type=int, default=2, help="eval prompts per task (default: 2)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per request (default: 16)")
    p.add_argument(
        "--min-batches",
        type=int,
        default=4,
        help="warm and eval prompts per task raised to fill at least this many batches each (default: 4)",
    )
    p.add_argument("--prompts", type=Path, default=None, help="prompt JSONL (default: bench policies')")
    p.add_argument(
        "--out", type=Path, default=ROOT / OUT, help=f"folder of the points' JSON (default: {OUT})"
    )
    p.add_argument("--force", action="store_true", help="rerun points whose JSON exists")
    args, extra = p.parse_known_args(argv)
    if args.min_batches < 1:
        p.error(f"--min-batches {args.min_batches}: must be >= 1")
    if args.tasks * args.eval < max(args.batches):
        p.error(
            f"--tasks {args.tasks} x --eval {args.eval} = {args.tasks * args.eval} eval prompts "
            f"never fill a batch of {max(args.batches)}"
        )
    return args, extra


def prompts_per_task(per_task: int, batch: int, args: argparse.Namespace) -> int:
    """``per_task`` prompts per task (``--warm`` or ``--eval``), raised so that ``--tasks`` tasks
    fill at least ``--min-batches`` batches of ``batch``."""
    return max(per_task, -(-args.min_batches * batch // args.tasks))


def command(link: float, batch: int, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The ``bench policies`` command line of one point (without the interpreter)."""
    warm, evals = (prompts_per_task(n, batch, args) for n in (args.warm, args.eval))
    cmd = ["-m", "moeserve.cli", "bench", "policies", "--policies", args.policies]
    cmd += ["--fractions", args.fractions, "--link-gbps", f"{link:g}", "--batch", str(batch)]
    cmd += ["--repeats", str(args.repeats), "--tasks", str(args.tasks), "--warm", str(warm)]
    cmd += ["--eval", str(evals), "--new-tokens", str(args.new_tokens)]
    if args.prompts is not None:
        cmd += ["--prompts", str(args.prompts)]
    return cmd + extra + ["--json"]


def run_point(
    path: Path, cmd: list[str], tool_argv: list[str], run: Callable = subprocess.run
) -> tuple[bool, str]:
    """Run one point and save its JSON (with the ``grid`` key) at ``path``; returns (ok, message).
    The file appears only after a run that exited 0 and printed JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's code, not an installed copy
    t0 = time.monotonic()
    proc = run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    try:
        data = json.loads(proc.stdout) if proc.returncode == 0 else None
    except json.JSONDecodeError:
        data = None
    if data is None:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        return False, f"failed (exit {proc.returncode}, {wall:.0f} s): " + " / ".join(tail)
    data["grid"] = {"command": "python " + " ".join(cmd), "tool": " ".join(tool_argv)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return True, f"{wall:.0f} s"


def main(argv: list[str] | None = None, run: Callable = subprocess.run) -> int:
    args, extra = parse_args(argv)
    tool_argv = ["python", "tools/policy_grid.py", *(sys.argv[1:] if argv is None else argv)]
    points = [(g, b) for g in args.links for b in args.batches]
    print(
        f"policy grid: {len(points)} points (links {', '.join(link_text(g) for g in args.links)} GB/s; "
        f"batches {', '.join(map(str, args.batches))}); buffers {args.fractions}; policies "
        f"{args.policies}; workload: {args.tasks} tasks x ({args.warm} warm + {args.eval} eval) "
        f"prompts = {args.tasks * args.eval} eval prompts, raised to fill {args.min_batches} batches; "
        f"{args.new_tokens} new tokens; "
        f"{args.repeats} repeats; extra flags: {' '.join(extra) or 'none'}; into {args.out}/",
        flush=True,
    )
    failed, t0 = 0, time.monotonic()
    for i, (link, batch) in enumerate(points, 1):
        path, cmd = point_file(args.out, link, batch), command(link, batch, args, extra)
        head = f"[{i}/{len(points)}] link {link_text(link)}, batch {batch}:"
        if path.exists() and not args.force:
            saved = json.loads(path.read_text()).get("grid", {}).get("command")
            if saved != "python " + " ".join(cmd):
                print(f"{head} {path} came from another command ({saved}); use --force or another --out")
                return 2
            print(f"{head} {path} exists, skipped (--force reruns it)", flush=True)
            continue
        ok, message = run_point(path, cmd, tool_argv, run)
        failed += not ok
        print(f"{head} {message}" + (f" -> {path}" if ok else ""), flush=True)
    print(f"policy grid: {len(points) - failed} of {len(points)} points saved, {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
