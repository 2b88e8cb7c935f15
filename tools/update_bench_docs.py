"""Regenerate docs/benchmarks.md and the policies section of docs/results.md from bench JSON.

Run after ``moeserve bench policies --json > runs/bench/policies.json`` and
``moeserve bench decode --json > runs/bench/decode.json``: the tables come from
``moeserve bench render``; the target checks and comparisons are computed from the same files.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
dec = json.loads((root / "runs/bench/decode.json").read_text())
pol = json.loads((root / "runs/bench/policies.json").read_text())
render = lambda f: subprocess.run(
    [sys.executable, "-m", "moeserve", "bench", "render", f],
    cwd=root,
    capture_output=True,
    text=True,
    check=True,
).stdout.strip()

# ---- benchmarks.md
rows = dec["results"]
ratios = [(r["batch"], r["ratio_vs_transformers"]) for r in rows if r.get("ratio_vs_transformers")]
ratio_txt = "; ".join(f"batch {b}: ours / transformers = {x:.2f}" for b, x in ratios)
bench = f"""# Benchmarks

## Decode TPOT vs buffer size and link bandwidth (`moeserve bench decode`)

Issue #2's decode benchmark on the bundled model, on this project's 2-core CPU machine (no GPU).
Command (the JSON is rendered to the table below by `moeserve bench render`):

```bash
moeserve bench decode --json > runs/bench/decode.json
moeserve bench render runs/bench/decode.json
python tools/update_bench_docs.py   # writes this file
```

For every buffer size (share of all 512 experts), link setting (off = plain memcpy; on = the I/O
thread holds an emulated link of `link_gbps` GB/s plus `link_latency_us` per copy) and batch size,
the engine decodes `new_tokens` greedy tokens for seeded random prompts, `repeats` times after a
warm-up run; TPOT is the mean decode-step time of a run, and the figure is the median over runs.
With every expert resident, the same prompts also run through `transformers` `generate` (eager
experts) in the same process with the same thread count.

{render("runs/bench/decode.json")}

With every expert resident: {ratio_txt} (below 1 means moeserve is faster).

Reading the table:
- Below 100%, the default `eam` policies run (they are skipped when everything is resident), so
  "link off" rows also move prefetched experts; with memcpy transfers those copies are nearly free
  for the link but still cost CPU time on a 2-core machine shared by the compute thread and the
  I/O thread.
- The CPU is shared with other work on this machine (load average 2-4 during the run); repeated
  runs of the same row vary by up to ~30%.
- `--cpu-threads 1` is the default: on this machine 2 intra-op threads made small-expert steps
  several times slower under load (see `docs/architecture.md`).
"""
(root / "docs/benchmarks.md").write_text(bench)

# ---- results.md policies section
res = pol["results"]


def get(frac, name):
    return next(r for r in res if abs(r["buffer_fraction"] - frac) < 1e-9 and r["policy"] == name)


resident = get(1.0, "all-resident")
fracs = sorted({r["buffer_fraction"] for r in res if r["buffer_fraction"] < 1})
rows_eam = [n for n in ("eam", "eam-paper") if any(r["policy"] == n for r in res)]


def verdict(ok):
    return "met" if ok else "not met"


checks = []
for frac in fracs:
    od = get(frac, "on-demand+lru")
    vals = [get(frac, n)["blocking_ms_per_token"] / od["blocking_ms_per_token"] for n in rows_eam]
    checks.append(
        f"| {frac:.0%} | blocking: eam / on-demand | "
        + " | ".join(f"{v:.2f} ({verdict(v <= 0.40)})" for v in vals)
        + " | <= 0.40 |"
    )
lru, orc = get(0.25, "on-demand+lru"), get(0.25, "oracle")
hr = [get(0.25, n)["hit_rate"] / lru["hit_rate"] for n in rows_eam]
checks.append(
    "| 25% | hit rate: eam / lru | "
    + " | ".join(f"{v:.2f} ({verdict(v >= 1.5)})" for v in hr)
    + " | >= 1.5 |"
)
gap = [100 * (orc["hit_rate"] - get(0.25, n)["hit_rate"]) for n in rows_eam]
checks.append(
    "| 25% | hit rate: oracle - eam (points) | "
    + " | ".join(f"{v:.1f} ({verdict(v <= 5)})" for v in gap)
    + " | <= 5 |"
)
tp = [get(0.25, n)["tpot_ms"] / resident["tpot_ms"] for n in rows_eam]
checks.append(
    "| 25% | TPOT: eam / all-resident | "
    + " | ".join(f"{v:.2f} ({verdict(v <= 1.5)})" for v in tp)
    + " | <= 1.5 |"
)
tp_orc = orc["tpot_ms"] / resident["tpot_ms"]
st_ = pol["settings"]
link_ms = {
    n: 1e3
    * get(0.25, n)["bytes_per_token"]
    * st_["batch"]
    * (1 / (st_["link_gbps"] * 1e9) + st_["link_latency_us"] * 1e-6 / st_["expert_bytes"])
    for n in ("eam", "oracle", "on-demand+lru")
}
link_txt = ", ".join(f"`{n}` {v:.1f} ms" for n, v in link_ms.items())
mc = []
for frac in fracs:
    e = get(frac, "eam")
    beaten = [
        n
        for n in ("on-demand+lru", "next-layer-all+lru", "hot-experts+lru", "model-counts", "eam-paper")
        if any(r["policy"] == n for r in res)
        and e["hit_rate"] > get(frac, n)["hit_rate"]
        and e["blocking_ms_per_token"] < get(frac, n)["blocking_ms_per_token"]
    ]
    m = get(frac, "model-counts")
    od = get(frac, "on-demand+lru")
    mc.append(
        f"- {frac:.0%} buffer: `eam` beats {', '.join(f'`{b}`' for b in beaten) or 'none of the other rows'} on both hit rate and blocking; "
        f"hit rate {e['hit_rate']:.3f} (eam-paper {get(frac, 'eam-paper')['hit_rate']:.3f}, model-counts {m['hit_rate']:.3f}), "
        f"bytes moved {e['bytes_per_token'] / od['bytes_per_token']:.2f}x on-demand's."
    )
    if any(r["policy"] == "on-demand+eam-reuse" for r in res):
        re_ = get(frac, "on-demand+eam-reuse")
        mc.append(
            f"  Caching alone: `eam-reuse` hit rate {re_['hit_rate']:.3f} vs LRU {od['hit_rate']:.3f}, "
            f"bytes moved {re_['bytes_per_token'] / od['bytes_per_token']:.2f}x LRU's."
        )
mc_lines = "\n".join(mc)
look = root / "runs/bench/lookahead.json"
look_txt = ""
if look.exists():
    lk = json.loads(look.read_text())
    ls_ = lk["settings"]
    look_rows = "\n".join(
        f"| {r['distance']} | {r['topk_precision']:.3f} | {r['top2k_recall']:.3f} | {r['n']} |"
        for r in lk["results"]
    )
    look_txt = f"""
### How well the router lookahead guesses (`moeserve bench lookahead`)

```bash
moeserve bench lookahead --json > runs/bench/lookahead.json
```

The same workload, all experts resident; at every MoE layer of every decode step the router of
layer `l + d` applied to the residual entering layer `l` guesses each token's top-{ls_["top_k"]}
there (chance: {ls_["chance_precision"]:.3f}). For comparison, EAMC matching's per-token top-4
precision at distance 1 on this model is about 0.21 (`moeserve trace predict-eval`, docs/tracer.md).

| distance d (MoE layers) | top-{ls_["top_k"]} precision | top-{2 * ls_["top_k"]} recall | routed choices |
|---|---|---|---|
{look_rows}
"""
section = f"""<!-- BEGIN policies (owner: runtime, issue #5) -->
## Prefetching and caching policies on the runtime (`moeserve bench policies`)

MoE-Infinity's Tables 2, 3 and 5 on our runtime and the bundled model: every prefetch/cache policy,
buffers of 10%, 25% and 50% of all experts, an emulated host->device link, one run. Command:

```bash
moeserve bench policies --json > runs/bench/policies.json
moeserve bench render runs/bench/policies.json
python tools/update_bench_docs.py   # writes this section
```

Workload: {len(pol["settings"]["tasks"])} tasks drawn (seeded) from `../shared/data/prompts/prompts_combined.jsonl`;
per task, 4 prompts warm the EAMC and the learned baselines and 2 other prompts are measured (the
EAMC is warmed on a disjoint set); eval batches of {pol["settings"]["batch"]} requests decode
{pol["settings"]["new_tokens"]} greedy tokens each. Every run starts from a fresh buffer. The oracle
replays the expert-access log recorded in the on-demand run (perfect prefetch + Belady). All runs,
including the all-resident reference, produced identical tokens (the benchmark checks it).

**All experts resident** (the TPOT reference): TPOT {resident["tpot_ms"]:.2f} ms.

{render("runs/bench/policies.json")}

"Blocking" is the time the compute thread waited for expert copies (the paper's GPU blocking time),
per generated token; "prefetch precision" is prefetches used / prefetches that landed in a slot.

### Targets of issue #5, measured in this run

| buffer | figure | `eam` (default: EAMC + router lookahead) | `eam-paper` (EAMC only, all later layers) | target |
|---|---|---|---|---|
{chr(10).join(checks)}

For scale: the oracle's own TPOT is {tp_orc:.2f}x the all-resident run's at 25%.

### What the figures say

{mc_lines}
- `eam-paper` is MoE-Infinity's policy as published: EAMC matching plans every later layer. On
  this model its per-token precision is low (about 0.21 top-4, `docs/tracer.md`): the tiny model
  activates many experts per request (decode activation ratio ~0.46 over 32 tokens,
  `docs/model-card.md`), far less sparse than the 128-expert models the paper's gains come from.
  The default `eam` adds the router lookahead (below) for the next MoE layer and plans only that
  layer (`--router-lookahead 1`); the EAMC still contributes to that layer's plan and the request
  EAMs drive the cache.
- The oracle (perfect prefetch + Belady) stays far ahead on hit rate. TPOT is bounded by the
  emulated link: at 25% the experts moved per decode step occupy the link for {link_txt} per step
  (bytes per token x batch at the link's bandwidth and per-copy latency), against an all-resident
  step of {resident["tpot_ms"]:.1f} ms; no overlap can bring a step below its link time.
- The link is emulated (`link_gbps`, `link_latency_us` in the settings line); on this CPU machine
  expert compute and copies share 2 cores, so TPOT differences mix blocking with CPU contention.
{look_txt}<!-- END policies -->
"""
r = (root / "docs/results.md").read_text()
if "<!-- BEGIN policies" in r:
    r = re.sub(r"<!-- BEGIN policies.*?<!-- END policies -->\n", section, r, flags=re.S)
else:
    r = r.rstrip() + "\n\n" + section
(root / "docs/results.md").write_text(r)
print("\n".join(checks))
print(ratio_txt)
