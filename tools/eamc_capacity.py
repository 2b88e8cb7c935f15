"""EAMC capacity: what the prediction gains from more entries against what matching costs.

MoE-Infinity §7.5 (Figure 13) finds that a small collection, up to about 120 entries or 3% of
the requests served, gives every model its lowest latency. This tool measures both sides of that
choice on our own code:

* **prediction** -- ``tracer.predict_eval`` (the protocol of ``moeserve trace predict-eval``) on
  request traces of the bundled model, recorded with ``moeserve trace record`` from the
  task-labelled prompts in ``../shared/data/prompts`` (two workloads: few tasks with many
  prompts each, and many tasks with few), at each capacity: the EAMC's precision at one and two
  layers ahead beside the request's own EAM (the ``eam`` policy's own term, which needs no
  collection). Warm requests fill the collection in file order; once it is full, each new one
  replaces the most similar entry (§4.2), as in serving.
* **matching cost** -- the ``eam`` policy's incremental matcher
  (``tracer.prefix_match.PrefixMatcher``) at the Qwen3-30B-A3B shape (48 layers, 128 experts) and
  batch 16, on a collection filled to capacity with synthetic EAMs (``tracer.synth``):
  ``begin_step`` (the full match a step pays when its batch changed, or when a plan computes the
  EAMC term after plans without it) and ``update_rows`` of one layer (each later plan with the
  term). Thread CPU time, median over repeats.

Traces are recorded once into ``runs/eamc_capacity/`` and reused. Prints a table, ``--json`` the
settings and rows, ``--doc`` writes the table into ``docs/tracer.md`` (block
``eamc-capacity``)::

    python tools/eamc_capacity.py --doc
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.eamc import EAMC  # noqa: E402
from tracer.predict_eval import evaluate  # noqa: E402
from tracer.prefix_match import PrefixMatcher  # noqa: E402
from tracer.synth import synthetic_eams  # noqa: E402
from tracer.trace_file import load_traces  # noqa: E402

PROMPTS = ROOT.parent / "shared/data/prompts/prompts_combined.jsonl"
OUT = ROOT / "runs/eamc_capacity"
# (name, tasks, warm prompts per task, eval prompts per task, seed)
WORKLOADS = (("120 tasks x 12", 120, 12, 2, 0), ("400 tasks x 3", 400, 3, 1, 1))
CAPACITIES = (32, 64, 128, 256, 512, 1000)
COST_SHAPE = (48, 128, 16)  # Qwen3-30B-A3B: layers, experts; batch


def record(name: str, tasks: int, per_task: int, skip: int, seed: int, max_tokens: int) -> Path:
    """The trace file of ``tasks`` x ``per_task`` prompts (after ``skip`` per task), recorded
    with the bundled model unless it is there already."""
    path = OUT / f"{name}.jsonl"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "moeserve", "trace", "record", "--prompts", str(PROMPTS),
            "--out", str(path.with_suffix(".part")), "--tasks", str(tasks), "--per-task", str(per_task),
            "--skip", str(skip), "--max-tokens", str(max_tokens), "--batch", "16", "--seed", str(seed),
        ]  # fmt: skip
        path.with_suffix(".part").unlink(missing_ok=True)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        path.with_suffix(".part").rename(path)
    return path


def precision(warm: list, evals: list, capacity: int, matches: int) -> dict[str, float]:
    """``{"eamc d=1", "eamc d=2", "own d=1", "own d=2"}`` precision at ``capacity``."""
    rows = evaluate(warm, evals, distances=(1, 2), matches=matches, capacity=capacity)["rows"]
    names = {"eamc": "eamc", "request-eam": "own"}
    return {f"{names[r['method']]} d={r['d']}": r["precision"] for r in rows if r["method"] in names}


def _cpu_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return float(np.median(times) * 1e6)


def matching_cost(capacity: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """``begin_step`` and one layer's ``update_rows`` (µs, thread CPU time, median of
    ``repeats`` after one warm-up) at :data:`COST_SHAPE` against a full collection."""
    L, E, B = COST_SHAPE
    eamc = EAMC(L, E, capacity=capacity)
    for eam in synthetic_eams(capacity, L, E, top_k=8, seed=seed):
        eamc.add(eam)
    rng = np.random.default_rng(seed)
    query = rng.poisson(0.5, size=(B, L, E)).astype(np.float32)  # a batch's EAMs so far
    m = PrefixMatcher(eamc, k=16)
    rows = query[:, 7:8].copy()
    begin = lambda: m.begin_step(query)  # noqa: E731
    update = lambda: m.update_rows([7], rows)  # noqa: E731
    begin()
    update()
    return {"begin_step_us": _cpu_us(begin, repeats), "update_rows_us": _cpu_us(update, repeats * 10)}


def run(args: argparse.Namespace) -> dict:
    loads = []
    for name, tasks, per_task, per_eval, seed in WORKLOADS:
        slug = name.replace(" ", "")
        warm = load_traces(record(f"{slug}-warm", tasks, per_task, 0, seed, args.max_tokens))
        evals = load_traces(record(f"{slug}-eval", tasks, per_eval, per_task, seed, args.max_tokens))
        loads.append((name, warm, evals))
    rows = []
    for cap in args.capacities:
        row: dict = {"capacity": cap}
        for name, warm, evals in loads:
            row[name] = precision(warm, evals, cap, args.matches)
        row.update(matching_cost(cap, args.repeats))
        rows.append(row)
        print(f"capacity {cap} done", file=sys.stderr, flush=True)
    first = loads[0][1][0]
    return {
        "settings": {
            "model": "bundled tiny-moe",
            "shape": f"{first.num_layers} layers, {first.num_experts} experts, top-{first.top_k}",
            "workloads": {name: {"warm": len(w), "eval": len(e)} for name, w, e in loads},
            "max_tokens": args.max_tokens,
            "matches": args.matches,
            "cost_shape": "qwen3-30b-a3b: 48 layers, 128 experts, batch 16",
            "repeats": args.repeats,
            "host": f"{platform.machine()}, python {platform.python_version()}",
        },
        "rows": rows,
    }


def table(result: dict) -> str:
    names = list(result["settings"]["workloads"])
    head = ["capacity"]
    for name in names:
        head += [f"{name}: EAMC d=1", "d=2", "own EAM d=1"]
    head += ["begin_step ms", "update_rows us"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [str(row["capacity"])]
        for name in names:
            p = row[name]
            cells += [f"{p['eamc d=1']:.3f}", f"{p['eamc d=2']:.3f}", f"{p['own d=1']:.3f}"]
        cells += [f"{row['begin_step_us'] / 1e3:.2f}", f"{row['update_rows_us']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    s = result["settings"]
    loads = ", ".join(f"{n}: {v['warm']} warm / {v['eval']} eval requests" for n, v in s["workloads"].items())
    lines.append("")
    lines.append(
        f"Settings: `model={s['model']}` ({s['shape']}), {loads}, `max_tokens={s['max_tokens']}`, "
        f"`matches={s['matches']}`; matching cost at {s['cost_shape']}, median of {s['repeats']} "
        f"(`update_rows`: {10 * s['repeats']}), {s['host']}."
    )
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = ROOT / "docs/tracer.md"
    body = doc.read_text()
    pattern = re.compile(r"(<!-- BEGIN eamc-capacity -->\n).*?(<!-- END eamc-capacity -->)", re.S)
    if not pattern.search(body):
        raise SystemExit(f"{doc}: no BEGIN/END eamc-capacity markers")
    doc.write_text(pattern.sub(lambda m: f"{m.group(1)}{text}\n{m.group(2)}", body))
    print(f"wrote {doc.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    p.add_argument(
        "--matches", type=int, default=16, help="EAMC matches per query (the eam policy's default)"
    )
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--doc", action="store_true", help="write the table into docs/tracer.md")
    args = p.parse_args(argv)
    args.capacities = [int(x) for x in args.capacities.split(",")]
    if not PROMPTS.exists():
        raise SystemExit(f"{PROMPTS}: not found (the tool needs ../shared/data beside the checkout)")
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
    if args.doc:
        write_doc(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
