"""Decode and prefill cost of this tree against an older commit, measured in one run.

Usage (from the repository root; prints a Markdown report, or writes it with ``--out``)::

    python tools/bench_regression.py --base 8757dca --out runs/bench-regression.md

The base commit is exported with ``git archive`` into a temporary folder (no worktree, nothing in
``.git`` changes). Each repeat starts one worker process per tree, in alternating order (old, new,
new, old, ...), so both trees see the same machine load; a worker imports ``moe_runtime`` from its
tree (``PYTHONPATH``), loads the bundled model (this tree's copy, so both run the same weights)
with one intra-op thread, and times the rows below, :data:`RUNS` runs each, keeping the fastest.
Per row and tree it reports process CPU time per decode step (every thread of the process: the
compute thread and the I/O threads; robust to other work sharing the CPU) and wall time per step;
the ratio new/old is taken per repeat (the two workers of a repeat ran back to back), and the
table gives the median ratio with the lowest and highest. Rows: every expert resident at batch 1,
3 (the CPU's ``few`` path) and 8, a 25% buffer (default ``eam`` policies) at batch 1 and 8,
``--new-tokens`` greedy tokens after a warm-up run; prefill: one ``--prefill-len``-token prompt,
all resident, admission to first token. Every run draws prompts no earlier run used (the same
seeded draws in both trees), so a tree with prefix caching prefills them as one without does. The
worker only uses APIs both trees have (``LLMEngine.from_pretrained``, ``add_request``, ``step``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3  # timed runs per row in a worker; a worker reports its fastest (least disturbed) run
DECODE_ROWS = [(1.0, 1), (1.0, 3), (1.0, 8), (0.25, 1), (0.25, 8)]  # (buffer fraction, batch)


def worker(model: str, new_tokens: int, prompt_len: int, prefill_len: int, eager: bool = False) -> dict:
    """Time every row in this process (``moe_runtime`` from ``PYTHONPATH``); returns
    ``{row name: {"cpu_ms": per step, "wall_ms": per step}}``. A tree that compiles CPU decode
    steps (``RuntimeConfig.compile_decode``, ``moeserve serve``'s default) runs them compiled,
    compiled before the warm-up as serve does, unless ``eager``."""
    import numpy as np
    import torch

    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    out = {}

    def moved(engine) -> int:
        return engine.buffer.stats.demand_bytes + engine.buffer.stats.prefetch_bytes

    def timed_steps(engine, prompts, max_tokens, skip_first: bool) -> tuple[float, float, int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
        if skip_first:  # the prefill step (every prompt fits one step)
            engine.step()
        cpu, wall, steps = 0.0, 0.0, 0
        while engine.has_unfinished():
            c0, w0 = time.process_time(), time.perf_counter()
            engine.step()
            cpu += time.process_time() - c0
            wall += time.perf_counter() - w0
            steps += 1
        return cpu, wall, steps

    def fresh(vocab: int, rows: int, length: int) -> list[list[int]]:
        """Prompts no earlier run used: a tree with prefix caching would otherwise serve a repeated
        prompt from its cache (the prefill row would time a cache hit, not a prefill)."""
        return rng.integers(0, vocab, size=(rows, length)).tolist()

    compiled = (
        {}
        if eager or "compile_decode" not in RuntimeConfig.__dataclass_fields__
        else {"compile_decode": True}
    )
    for fraction, batch in DECODE_ROWS:
        rt = RuntimeConfig(
            max_model_len=256, max_batch_size=batch, buffer_fraction=fraction, cpu_threads=1, **compiled
        )
        with LLMEngine.from_pretrained(model, rt) as engine:
            if getattr(engine, "compiled", None) is not None:
                engine.capture_graphs()  # the compile, before serving (moeserve serve)
            vocab = engine.config.vocab_size
            # warm-up: as long as the timed run
            timed_steps(engine, fresh(vocab, batch, prompt_len), new_tokens + 1, True)
            before = moved(engine)
            timed = [
                timed_steps(engine, fresh(vocab, batch, prompt_len), new_tokens + 1, True)
                for _ in range(RUNS)
            ]
            steps = sum(r[2] for r in timed)
            kib = (moved(engine) - before) / 1024 / steps
        out[f"decode {fraction:.0%} batch {batch}"] = {
            "cpu_ms": 1e3 * min(r[0] / r[2] for r in timed),
            "wall_ms": 1e3 * min(r[1] / r[2] for r in timed),
            "kib_moved": kib,
        }
    rt = RuntimeConfig(max_model_len=prefill_len + 8, max_batch_size=1, cpu_threads=1)
    with LLMEngine.from_pretrained(model, rt) as engine:
        vocab = engine.config.vocab_size
        timed_steps(engine, fresh(vocab, 1, prefill_len), 1, False)  # warm-up
        timed = [timed_steps(engine, fresh(vocab, 1, prefill_len), 1, False) for _ in range(RUNS)]
    out[f"prefill 100% {prefill_len} tokens"] = {
        "cpu_ms": 1e3 * min(r[0] for r in timed),
        "wall_ms": 1e3 * min(r[1] for r in timed),
    }
    return out


def fail(msg: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"bench_regression: {msg}", file=sys.stderr)
    raise SystemExit(2)


def export(commit: str, dest: Path) -> str:
    """Write ``commit``'s tree into ``dest``; returns its full hash."""
    full = subprocess.run(
        ["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if full.returncode:
        fail(f"--base: unknown commit {commit!r}")
    archive = subprocess.run(
        ["git", "archive", full.stdout.strip()], cwd=ROOT, capture_output=True, check=True
    )
    with tempfile.TemporaryFile() as f:
        f.write(archive.stdout)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    return full.stdout.strip()


def run_worker(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(args.model)]
    cmd += ["--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len)]
    cmd += ["--prefill-len", str(args.prefill_len)] + (["--eager"] if getattr(args, "eager", False) else [])
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if res.returncode:
        fail(f"the worker in {tree.name} failed: {(res.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def head_commit() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    )
    return rev.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def table(runs: dict[str, list[dict]]) -> list[str]:
    """The Markdown table of ``runs`` (``{"old": [worker result per repeat], "new": [...]}``)."""
    rows = list(runs["new"][0])
    lines = [
        "| row | old CPU ms | new CPU ms | new/old CPU | spread | best/best CPU "
        "| old wall ms | new wall ms | new/old wall | spread | best/best wall | KiB moved per step old, new |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row]
        for key in ("cpu_ms", "wall_ms"):
            old = [r[row][key] for r in runs["old"]]
            new = [r[row][key] for r in runs["new"]]
            ratios = [n / o for n, o in zip(new, old)]
            cells += [
                f"{statistics.median(old):.2f}",
                f"{statistics.median(new):.2f}",
                f"{statistics.median(ratios):.2f}",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
                f"{min(new) / min(old):.2f}",
            ]
        kib = [statistics.median(r[row].get("kib_moved", 0.0) for r in runs[t]) for t in ("old", "new")]
        cells.append(f"{kib[0]:.0f}, {kib[1]:.0f}" if any(kib) else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def settings_of(base: str, args, started_load: float) -> dict:
    import torch

    return {
        "old": base[:12],
        "new": head_commit(),
        "model": "moe_runtime/assets/tiny-moe (bundled)",
        "repeats": args.repeats,
        "runs_per_worker": f"{RUNS} (fastest kept)",
        "order": "old,new then new,old, alternating",
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "prefill_len": args.prefill_len,
        "cpu_threads": 1,
        "new_decode": "eager (--eager)"
        if getattr(args, "eager", False)
        else "compiled where every expert is resident (serve's default)",
        "load_avg_1min": f"{started_load:.2f}",
        "torch": torch.__version__,
    }


#: what the figures mean, for the report and the docs block
LEGEND = [
    "CPU ms: process CPU time (all threads) per decode step, or per prompt for the prefill row;",
    f"wall ms: elapsed time, same unit. Each repeat keeps its fastest of {RUNS} runs; old and new",
    "figures are medians over repeats. Ratios are taken per repeat (the two trees ran back to",
    "back) and summarised by their median and range; best/best divides the two trees' fastest",
    "repeats, the figure other work on the machine disturbs least. Below 1.00 the new tree is",
    "cheaper. KiB moved: expert bytes copied host->device per step (demand and prefetch; buffers",
    "below 100%), median over repeats: prefetch policies move different amounts, which costs CPU",
    "time.",
]


def render(result: dict) -> str:
    """The docs block of ``--json``'s output (``tools/docs.py``): the table and its settings."""
    settings = ", ".join(f"`{k}={v}`" for k, v in result["settings"].items())
    return "\n".join([*LEGEND, "", *table(result["runs"]), "", "Settings: " + settings, ""])


def report(base: str, runs: dict[str, list[dict]], args, started_load: float) -> str:
    settings = settings_of(base, args, started_load)
    return "\n".join(
        [
            "# Decode and prefill cost against an older commit (`tools/bench_regression.py`)",
            "",
            "Generated by the command below (do not edit by hand); see the tool's docstring for",
            "the method.",
            *LEGEND,
            "",
            "```bash",
            f"python tools/bench_regression.py --base {args.base}"
            + (" --eager" if getattr(args, "eager", False) else "")
            + (f" --out {args.out}" if getattr(args, "out", None) else ""),
            "```",
            "",
            *table(runs),
            "",
            "Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()),
            "",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="8757dca", help="older commit to compare against")
    p.add_argument("--repeats", type=int, default=5, help="worker pairs (default 5)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--out", help="write the Markdown report here (default: print it)")
    p.add_argument(
        "--eager", action="store_true", help="this tree's decode steps eagerly (no compiled CPU decode step)"
    )
    p.add_argument(
        "--json", action="store_true", help="print the runs and settings as JSON (tools/docs.py's block)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=str(ROOT / "moe_runtime/assets/tiny-moe"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.new_tokens, args.prompt_len, args.prefill_len, args.eager)))
        return 0
    if args.repeats < 1:
        fail(f"--repeats must be >= 1, got {args.repeats}")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-regression-") as tmp:
        old_tree = Path(tmp) / "old"
        base = export(args.base, old_tree)
        trees = {"old": old_tree, "new": ROOT}
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for rep in range(args.repeats):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
                runs[name].append(run_worker(trees[name], args))
    if args.json:
        print(json.dumps({"settings": settings_of(base, args, load), "runs": runs}, indent=1))
        return 0
    text = report(base, runs, args, load)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
