"""gpt-oss attention cost of this tree against an older commit, measured in one run.

Usage (from the repository root; writes ``docs/bench-attention.md``)::

    python tools/bench_attention.py --base 7c5f595 --out docs/bench-attention.md

Times one call of ``moe_runtime.layers.attention.attention`` at gpt-oss-20b's head shapes (64
query heads, 8 KV heads, head dim 64, sliding window 128), bf16, one intra-op thread, CPU: a plain
layer (no sinks), a full layer with sinks and a sliding layer with sinks, for a decode step of
batch 1 and 8 at context 2048 and a 512-token prefill. The layers share one step, as the 24 layers
of a forward pass do (masks a tree builds once per step are built before the timed calls). The
base commit is exported with ``git archive`` into a temporary folder; each repeat starts one
worker process per tree in alternating order (old, new, new, old, ...) so both see the same
machine load; a worker keeps the fastest of :data:`CALLS` calls per row. The table gives each
tree's median over the repeats and the KV bytes of one sequence row of the two layers.
"""

from __future__ import annotations

import argparse
import inspect
import io
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
CALLS = 10  # timed calls per row in a worker; the fastest is kept
HQ, HKV, D, WINDOW, CTX = 64, 8, 64, 128, 2048
ROWS = [("decode, batch 1, context 2048", 1, CTX - 1, 1), ("decode, batch 8, context 2048", 8, CTX - 1, 1)]
ROWS += [("prefill, 512 tokens", 1, 0, 512)]
LAYERS = ("plain", "sinks", "sinks + window")


def worker() -> dict:
    """Time every row in this process (``moe_runtime`` from ``PYTHONPATH``):
    ``{row: {layer: ms}, "kv_bytes": {...}}``. Uses the APIs of both trees: the older one takes
    ``window`` per call and keeps full-length rows, the newer one takes the window from the cache."""
    import torch

    from moe_runtime.engine.context import StepContext
    from moe_runtime.layers.attention import attention
    from moe_runtime.layers.kv_cache import KVCache

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ring = "windows" in inspect.signature(KVCache).parameters
    per_call_window = "window" in inspect.signature(attention).parameters
    cpu, dt = torch.device("cpu"), torch.bfloat16
    sinks = torch.randn(HQ).to(dt)
    out: dict = {}
    for name, batch, past, new in ROWS:
        cache = KVCache(2, batch, HKV, CTX, D, dt, cpu, **({"windows": {0: WINDOW}} if ring else {}))
        for layer in range(2):
            cache.k[layer].normal_()
            cache.v[layer].normal_()
        ids = [str(i) for i in range(batch)]
        step = StepContext.build(ids, list(range(batch)), [past] * batch, [new] * batch, [True] * batch, cpu)
        t = batch * new
        q, k, v = (
            torch.randn(t, HQ, D, dtype=dt),
            torch.randn(t, HKV, D, dtype=dt),
            torch.randn(t, HKV, D, dtype=dt),
        )
        window = [WINDOW] if per_call_window else []
        calls = {
            "plain": (1, []),
            "sinks": (1, [sinks]),
            "sinks + window": (0, [sinks, *window]),
        }  # layer, args
        out[name] = {}
        for layer_name, (layer, extra) in calls.items():
            attention(q, k, v, layer, cache, step, *extra)  # warm-up; builds the step's masks where cached
            times = []
            for _ in range(CALLS):
                t0 = time.perf_counter()
                attention(q, k, v, layer, cache, step, *extra)
                times.append(time.perf_counter() - t0)
            out[name][layer_name] = 1e3 * min(times)
        out["kv_bytes"] = {"full layer": cache.k[1][0].nbytes * 2, "sliding layer": cache.k[0][0].nbytes * 2}
    return out


def _run_worker(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.splitlines()[-1])


def render(base: str, head: str, old: list[dict], new: list[dict]) -> str:
    """The markdown document of both trees' medians over the repeats."""
    lines = [
        "# gpt-oss attention cost against an older commit (`tools/bench_attention.py`)",
        "",
        f"One `attention()` call at gpt-oss-20b head shapes ({HQ} query / {HKV} KV heads, head dim {D}, "
        f"window {WINDOW}), bf16, 1 thread, CPU; fastest of {CALLS} calls per worker, median over "
        f"{len(old)} alternating worker pairs. Base `{base}`, this tree `{head}`. Regenerate with:",
        "",
        "```bash",
        f"python tools/bench_attention.py --base {base} --out docs/bench-attention.md",
        "```",
        "",
        "| row | layer | base ms | this tree ms | this / base |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, *_ in ROWS:
        for layer in LAYERS:
            a = statistics.median(r[name][layer] for r in old)
            b = statistics.median(r[name][layer] for r in new)
            lines.append(f"| {name} | {layer} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    kv_old, kv_new = old[0]["kv_bytes"], new[0]["kv_bytes"]
    lines += [
        "",
        f"KV bytes of one sequence row (K and V, {CTX} positions): full layer {kv_old['full layer']} -> "
        f"{kv_new['full layer']}, sliding layer {kv_old['sliding layer']} -> {kv_new['sliding layer']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="older commit to compare with")
    ap.add_argument("--repeats", type=int, default=2, help="worker pairs (default 2)")
    ap.add_argument("--out", type=Path, help="markdown file to write (default: stdout)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker()))
        return 0
    if not args.base or args.repeats < 1:
        ap.error("--base COMMIT and --repeats >= 1 are required")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", args.base, "moe_runtime"], cwd=ROOT, capture_output=True, check=True
        )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        old, new = [], []
        for i in range(args.repeats):
            order = [(Path(tmp), old), (ROOT, new)]
            for tree, results in order if i % 2 == 0 else order[::-1]:
                results.append(_run_worker(tree))
    text = render(args.base, head.strip() or "HEAD", old, new)
    text += f"Load average (1 min) before / after the run: {load[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs.\n"
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
