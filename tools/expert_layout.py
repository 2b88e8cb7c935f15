"""Where a cache policy's slots put a layer's experts, and what that costs the CPU's expert calls.

On the CPU, ``torch.nn.functional.grouped_mm`` loops over every group of its slot range in C++,
empty ones included, so a batch of experts in scattered slots costs more than the same experts
in adjacent ones (``moe_runtime.layers.experts.MAX_GAP``: a longer run of unused slots starts a
new call). LRU on a buffer far smaller than the working set evicts in fill order and lands each
layer's misses in adjacent slots; a cache that keeps the experts it expects to reuse (``eam-reuse``)
leaves them where they landed, and the next misses fill the slots between them. This tool counts,
per policy, the grouped calls' segments, the slots they span against the experts they use, the
segments of one expert, the batches of one expert and the compute thread's CPU time in
``run_experts`` per MoE layer (thread time: waits for copies excluded), beside the hit rate and
blocking. Counts are deterministic for a given host's timing of copies to within a few percent;
the CPU time is one pass, for comparison within a run.

One engine per policy (labels as ``tools/policy_ab.py``: ``bench policies`` rows or
``eam@<arm>``), each warmed on the warm prompts, then every eval batch decoded once::

    python tools/expert_layout.py --policies on-demand+lru,eam@cache --fraction 0.1 --batch 4 --link-gbps 0

``--doc`` runs the two link-off 10% points of issue #15's grid that ``eam`` misses most (batch 4
and 16, on-demand + LRU against ``eam`` held in its caching arm) and writes their tables into
``docs/results.md`` (block ``expert-layout``, after the grid)::

    python tools/expert_layout.py --doc
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from policy_ab import add_workload_args, build_engine, load_workload, parse_policies  # noqa: E402

from moeserve.bench.policies import DecodeTimes, _run_batches  # noqa: E402


class LayoutCounter:
    """Counts ``LayerPlan.calls``' segments and ``run_experts``' CPU time while installed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.segments = self.used = self.span = self.single_segments = self.one_expert_batches = 0
        self.layers, self.cpu_s = 0, 0.0

    def install(self) -> Callable[[], None]:
        """Wrap ``LayerPlan.calls`` and ``moe.run_experts`` to count; returns what undoes it."""
        from moe_runtime.layers import experts, moe

        calls, run = experts.LayerPlan.calls, moe.run_experts
        counter = self

        def counted_calls(plan, batch):  # type: ignore[no-untyped-def]
            for part, pos, segments, offs in calls(plan, batch):
                counter.segments += len(segments)
                counter.span += sum(count for _, count, _ in segments)
                counter.single_segments += sum(1 for _, count, _ in segments if count == 1)
                yield part, pos, segments, offs

        def timed_run(x, weights, ids_host, layer_run, *args, **kwargs):  # type: ignore[no-untyped-def]
            batches = layer_run.batches

            def counted_batches():  # type: ignore[no-untyped-def]
                for batch in batches():
                    counter.used += len(batch)
                    counter.one_expert_batches += len(batch) == 1
                    yield batch

            layer_run.batches = counted_batches
            c0 = time.thread_time()
            try:
                return run(x, weights, ids_host, layer_run, *args, **kwargs)
            finally:
                counter.cpu_s += time.thread_time() - c0
                counter.layers += 1

        experts.LayerPlan.calls = counted_calls
        moe.run_experts = timed_run

        def uninstall() -> None:
            experts.LayerPlan.calls, moe.run_experts = calls, run

        return uninstall


def measure(args, labels, specs, base, loaded, warm, evals, counter: LayoutCounter) -> list[dict]:  # type: ignore[no-untyped-def]
    """One row per policy: an engine warmed on ``warm``, then ``evals`` decoded once, counted."""
    rows = []
    for label, spec in zip(labels, specs):
        engine = build_engine(loaded, base, args.fraction, spec)
        try:
            _run_batches(engine, warm, args.batch, args.new_tokens)
            st = engine.buffer.stats
            lookups0, hits0, blocking0 = st.total_lookups, st.total_hits, sum(st.blocking_s)
            counter.reset()
            times = DecodeTimes()
            tpots, _ = _run_batches(engine, evals, args.batch, args.new_tokens, times)
            steps = len(tpots) * args.new_tokens
            lookups = st.total_lookups - lookups0
            per_layer = 1 / max(counter.layers, 1)
            rows.append(
                {
                    "policy": label,
                    "hit_rate": round((st.total_hits - hits0) / max(lookups, 1), 3),
                    "blocking_ms_per_step": round((sum(st.blocking_s) - blocking0) / steps * 1e3, 2),
                    "tpot_ms": round(statistics.median(tpots) * 1e3, 2),
                    "cpu_ms_per_step": round(statistics.median(times.cpu_s) * 1e3, 2),
                    "run_experts_cpu_us_per_layer": round(counter.cpu_s * per_layer * 1e6, 1),
                    "experts_per_layer": round(counter.used * per_layer, 2),
                    "segments_per_layer": round(counter.segments * per_layer, 2),
                    "slots_spanned_per_layer": round(counter.span * per_layer, 2),
                    "one_expert_segments_per_layer": round(counter.single_segments * per_layer, 2),
                    "one_expert_batches_per_layer": round(counter.one_expert_batches * per_layer, 2),
                }
            )
        finally:
            engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p, policies="on-demand+lru,eam@cache", fraction=0.1, batch=4)
    p.add_argument("--doc", action="store_true", help="write the link-off 10%% points into docs/results.md")
    args = p.parse_args(argv)
    if args.doc:
        return write_doc(argv or [])
    labels, specs = parse_policies(p, args)
    base, loaded, warm, evals, _ = load_workload(args)
    counter = LayoutCounter()
    uninstall = counter.install()
    try:
        rows = measure(args, labels, specs, base, loaded, warm, evals, counter)
    finally:
        uninstall()
    settings = {
        "fraction": args.fraction,
        "batch": args.batch,
        "link_gbps": args.link_gbps or "off",
        "tasks": args.tasks,
        "warm": args.warm,
        "eval": args.eval,
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "note": "one pass per policy; counts per MoE layer over the eval batches (prefill included)",
    }
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}, indent=2))
        return 0
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    keys = list(rows[0])[1:]
    lines = ["| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {r['policy']} | " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


# (buffer fraction, batch, warm and eval prompts per task): as tools/policy_grid.py sizes them
# (at least 4 batches of each)
DOC_POINTS = (("0.1", "4", "2"), ("0.1", "16", "8"))


def write_doc(argv: list[str]) -> int:
    """Run :data:`DOC_POINTS` (link off, ``on-demand+lru`` against ``eam@cache``; other arguments
    but ``--doc`` passed on) and write their tables into ``docs/results.md``."""
    rest = [a for a in argv if a != "--doc"]
    parts = []
    for fraction, batch, prompts in DOC_POINTS:
        cmd = ["--policies", "on-demand+lru,eam@cache", "--fraction", fraction, "--batch", batch]
        cmd += ["--warm", prompts, "--eval", prompts]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main([*cmd, "--link-gbps", "0", *rest, "--json"])
        result = json.loads(out.getvalue())
        settings = ", ".join(f"`{k}={v}`" for k, v in result["settings"].items())
        parts.append(f"Settings: {settings}.\n\n{table(result['rows'])}")
    block = f"""<!-- BEGIN expert-layout -->
### Where the caching arm's experts sit with no link, 10% buffer (`tools/expert_layout.py`)

The grid's link-off 10% rows are where `eam` was furthest behind on-demand+LRU (above): it runs
its caching arm there (prefetching never pays without a link). The `eam-reuse` cache hits where
LRU does not and blocks less, but the experts it keeps stay in the slots they landed in, so a
layer's misses land in the scattered slots between them; on the CPU a grouped call pays for
every unused slot it spans, or for a new call where the gap is long
(`moe_runtime.layers.experts.MAX_GAP`; an accelerator pays next to nothing for an empty group).
LRU on a buffer this small evicts in fill order: each layer's misses land side by side. Per MoE
layer, over one pass of the eval batches after the warm ones: the grouped calls' segments and
the slots they span against the experts used, and the compute thread's CPU time in the experts
(`run_experts_cpu_us_per_layer`, waits for copies excluded). TPOT and CPU per step are that one
pass's (the grid's paired rounds above are the verdict). Command:

```bash
python tools/expert_layout.py --doc
```

{(chr(10) * 2).join(parts)}
<!-- END expert-layout -->
"""
    doc = ROOT / "docs/results.md"
    text = doc.read_text()
    if "<!-- BEGIN expert-layout -->" in text:
        text = re.sub(
            r"<!-- BEGIN expert-layout -->.*?<!-- END expert-layout -->\n", lambda _: block, text, flags=re.S
        )
    else:
        text = text.replace(
            "<!-- END policy-grid-previous -->\n", "<!-- END policy-grid-previous -->\n\n" + block, 1
        )
    doc.write_text(text)
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
