"""Regenerate docs/benchmarks.md and the policies section of docs/results.md from bench JSON.

Run after ``moeserve bench decode --json > runs/bench/decode.json`` (this machine's CPU run; any
``runs/bench/decode-*.json``, e.g. the GPU session routine's, get a section each) and, for
docs/results.md, ``moeserve bench policies --json > runs/bench/policies.json`` (skipped when that
file is absent). The tables come from ``moeserve bench render``; the summaries and comparisons are
computed from the same files.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))
from moe_runtime.checkpoints.shapes import SHAPES  # noqa: E402

dec = json.loads((root / "runs/bench/decode.json").read_text())
render = lambda f: subprocess.run(
    [sys.executable, "-m", "moeserve", "bench", "render", f],
    cwd=root,
    capture_output=True,
    text=True,
    check=True,
).stdout.strip()


def summary(data: dict) -> str:
    """One sentence per figure the issue's targets name, computed from a decode JSON."""
    rows = data["results"]
    out = []
    for r in rows:
        if r.get("ratio_vs_transformers"):
            out.append(
                f"all resident, batch {r['batch']}: ours / transformers = {r['ratio_vs_transformers']:.2f}, "
                f"TPOT / HBM bound = {r['tpot_ms'] / r['hbm_bound_ms']:.1f}"
            )
    low = min(r["buffer_fraction"] for r in rows)
    for r in rows:
        if r["buffer_fraction"] == low < 1 and r["link_gbps"] is None and r["link_bound_ms"] > 0:
            out.append(
                f"{low:.0%} buffer, batch {r['batch']}: TPOT / link bound = {r['tpot_ms'] / r['link_bound_ms']:.1f}"
            )
    for r in data.get("prefill", []):
        if r["buffer_fraction"] == 1.0:
            out.append(f"prefill of {r['prompt_tokens']} tokens: {r['tokens_per_s']:.0f} prompt tokens/s")
    return "; ".join(out)


def other_runs() -> str:
    parts = []
    for path in sorted((root / "runs/bench").glob("decode-*.json")):
        data = json.loads(path.read_text())
        st = data["settings"]
        rel = path.relative_to(root)
        parts.append(
            f"### {st['device_name']}: {st['architecture']}, {st['layers']} layers, hidden {st['hidden']}, "
            f"{st['experts']} experts of {st['expert_bytes'] / 2**20:.2f} MiB, {st['dtype']} (`{rel.name}`)\n\n"
            f"{summary(data)}.\n\n{render(str(rel))}\n"
        )
    return "\n".join(parts) or (
        "None recorded yet: a session with a lent GPU records them with the routine below.\n"
    )


def extras(s) -> str:
    parts = [f"qk-norm ({s.qk_norm})"] if s.qk_norm != "none" else []
    parts += [f"shared expert {s.shared_intermediate}"] if s.shared_intermediate else []
    return ", ".join(parts + (["qkv bias"] if s.attention_bias else []))


shape_rows = "\n".join(
    f"| `{s.name}` | {s.num_layers} | {s.hidden} | {s.heads} / {s.kv_heads} x {s.head_dim} | {s.experts} | "
    f"{s.top_k} | {s.moe_intermediate} | {s.expert_bytes(2) / 2**20:.2f} | "
    f"{s.experts * s.expert_bytes(2) / 1e9:.2f} | {s.vocab} | {extras(s)} | {s.source} |"
    for s in SHAPES.values()
)
mix, qwen3 = SHAPES["mixtral-8x7b"], SHAPES["qwen3-30b-a3b"]
gb = lambda s, n: f"{s.checkpoint_bytes(n, 2) / 1e9:.1f} GB"

# ---- benchmarks.md
cpu_summary = summary(dec)
bench = f"""# Benchmarks

## Decode TPOT and prefill against their bounds (`moeserve bench decode`)

Issue #2's decode benchmark on the bundled model, with issue #14's bounds and prefill row, on this
project's 2-core CPU machine (no GPU). Command (the JSON is rendered to the table below by
`moeserve bench render`):

```bash
mkdir -p runs/bench
moeserve bench decode --json > runs/bench/decode.json
moeserve bench render runs/bench/decode.json
python tools/update_bench_docs.py   # writes this file
```

For every buffer size (share of all {dec["settings"]["experts"]} experts), link setting (off = plain
copies; on = the I/O thread holds an emulated link of `link_gbps` GB/s plus `link_latency_us` per
copy) and batch size, the engine decodes `new_tokens` greedy tokens for seeded random prompts,
`repeats` times after a warm-up run; TPOT is the mean decode-step time of a run, the figure is the
median over runs and "spread" the fastest and slowest run. With every expert resident, the same
prompts also run through `transformers` `generate` on the same device with the same dtype and
thread count. Hit rate, blocking and bytes per token count decode steps only. "CPU ms/step" is
the process's CPU time per decode step (compute and I/O threads, median over runs): other work on
a shared machine inflates it far less than TPOT, so compare it across runs.

Two lower bounds stand beside TPOT (milliseconds per decode step):
- **HBM bound**: bytes a step reads from device memory (resident dense weights, the embedding
  table only as a tied LM head; every distinct expert the step used, from the buffer's lookups;
  the KV cache at the run's mean context) / the device's memory bandwidth: `hbm_gbps` in the
  settings, from the data-sheet table of `moe_runtime/bench/hardware.py` on CUDA (it reuses the
  simulator's GPU profiles), a measured host-memory copy on the CPU (`hbm_source`), or `--hbm-gbps`.
- **Link bound**: bytes moved host->device per decode step / the link's bandwidth: with no
  emulated link, host->device copies of one expert measured in the same run (`h2d_gbps_measured`:
  pinned memory and CUDA events on a GPU, a memcpy on the CPU); with one, `link_gbps` plus
  `link_latency_us` per expert copy. Zero when every expert is resident.

The prefill rows time one `prefill_len`-token prompt from admission to its first token (chunks
of `max_num_batched_tokens`), with the same bounds over the prefill steps; transformers runs one
forward pass over the same prompt.

{render("runs/bench/decode.json")}

Summary: {cpu_summary}.

Reading the table:
- The CPU is shared with other work on this machine (`load_avg_1min` in the settings was taken at
  the start of the run); repeated runs of the same row vary by up to ~30%, so compare rows of one
  run, and read the spread column.
- On the CPU the "HBM" is host memory and the "link" a memcpy, both measured at the start of the
  run: the bounds say how far a step is from moving its bytes, not what a GPU would do.
- Below 100%, the default `eam` policies run (they are skipped when everything is resident), so
  "link off" rows also move prefetched experts; with memcpy transfers those copies are nearly free
  for the link but still cost CPU time on a 2-core machine shared by the compute thread and the
  I/O thread.
- `--cpu-threads 1` is the default: on this machine 2 intra-op threads made small-expert steps
  several times slower under load (see `docs/architecture.md`).
- Whether a change made these rows slower is measured in one run against the older commit, with
  the two trees' workers interleaved: `docs/bench-regression.md`, written by
  `python tools/bench_regression.py --base COMMIT --out docs/bench-regression.md`.

## Other devices and checkpoints

Every `runs/bench/decode-*.json` (the GPU session routine below writes them), rendered the same way.

{other_runs()}
## Real-shape checkpoints (`moeserve make-checkpoint`)

`moeserve make-checkpoint --shape NAME --layers N --out DIR [--dtype bf16|fp16|fp32] [--seed S]`
writes a random-weight Hugging Face checkpoint with the real per-layer shapes of a published MoE
model, keeping its first `N` decoder layers. Both `transformers` (`from_pretrained`) and moeserve
(`--model DIR`) load it. The shapes (`moe_runtime/checkpoints/shapes.py`; expert sizes in bf16):

| shape | layers | hidden | heads / KV heads x head dim | experts | top-k | expert width | expert MiB | experts GB per layer | vocab | extras | source |
|---|---|---|---|---|---|---|---|---|---|---|---|
{shape_rows}

- It is written one decoder layer at a time, one safetensors shard per layer plus one for the
  embeddings, final norm and LM head, with `model.safetensors.index.json`. The model is built by
  `transformers` on the `meta` device, and each shard's tensor names and layout come from
  `transformers`' own save conversion. So peak memory is one layer, not the model.
- Weights are `N(0, 0.02)`, norms 1, biases 0. Routers are `N(0, 3 / sqrt(hidden))`, so router
  logits of a unit-RMS hidden state have std 3. Routing then depends on the input and is far from
  uniform. The command prints layer 0's routing of 64 random tokens: its softmax entropy as a
  share of uniform's (the tests require it below 0.8), and how many distinct top-k sets it saw.
- The tokenizer is the bundled model's byte-level BPE, padded to the model's `vocab_size` with
  `<|reserved_N|>` entries that no merge produces. Every id a model emits decodes. EOS and padding
  are `<|endoftext|>` = 0, not the real models' ids.
- Example: `moeserve make-checkpoint --shape mixtral-8x7b --layers 4 --out runs/ckpt/mixtral-4l`
  writes {gb(mix, 4)} in bf16; `qwen3-30b-a3b` with 8 layers writes {gb(qwen3, 8)}. Check the disk
  first.

## GPU session routine

Whenever `status` of the device tool shows a GPU lent (`can_start_another` true), a session runs
the following. Everything a command writes under `$OUT` on the GPU machine comes back.

1. Here, from the project root: mark the start (step 3 copies what came back since) and fetch the
   wheels the GPU machine lacks (into `.whl/`, git-ignored).

   ```bash
   mkdir -p runs/bench && touch runs/bench/gpu-routine.start && ../shared/tools/gpu-wheels.sh llguidance threadpoolctl
   ```

2. Run each of these three commands with the device tool's `run`, `carry: [".whl"]`, and
   `timeout_s: 600`. After each one, copy its files back as in step 3: a reply brings only the
   latest command's files.

   GPU tests and the bundled model:

   ```bash
   python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit; nvidia-smi --query-gpu=name,memory.total --format=csv; timeout 300 python3 -m pytest -q -rs tests/test_devices.py 2>&1 | tee $OUT/gpu-tests.log; python3 -m moeserve bench decode --device cuda --dtype bf16 --link-gbps 0 --prefill-len 2048 --json > $OUT/decode-cuda-tiny-moe.json
   ```

   The Mixtral-8x7B shape, 4 layers ({gb(mix, 4)}):

   ```bash
   python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit; python3 -m moeserve make-checkpoint --shape mixtral-8x7b --layers 4 --out /tmp/ckpt/mixtral-4l && python3 -m moeserve bench decode --model /tmp/ckpt/mixtral-4l --device cuda --dtype bf16 --fractions 1.0,0.25 --link-gbps 0 --prefill-len 2048 --json > $OUT/decode-cuda-mixtral-8x7b-4l.json
   ```

   The Qwen3-30B-A3B shape, 8 layers ({gb(qwen3, 8)}):

   ```bash
   python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit; python3 -m moeserve make-checkpoint --shape qwen3-30b-a3b --layers 8 --out /tmp/ckpt/qwen3-8l && python3 -m moeserve bench decode --model /tmp/ckpt/qwen3-8l --device cuda --dtype bf16 --fractions 1.0,0.25 --link-gbps 0 --prefill-len 2048 --json > $OUT/decode-cuda-qwen3-30b-a3b-8l.json
   ```

3. Here, after each run: copy the JSON that came back (the device tool puts a run's files under
   `/work/.device/`) into `runs/bench/` and regenerate this file; each GPU run becomes a section
   above, named after its device.

   ```bash
   find /work/.device -name 'decode-cuda-*.json' -newer runs/bench/gpu-routine.start -exec cp {{}} runs/bench/ \\;
   python tools/update_bench_docs.py
   ```

   `runs/` is git-ignored. Commit the regenerated `docs/benchmarks.md`, and say which device the
   figures came from. The tool names the device in each section title.
"""
(root / "docs/benchmarks.md").write_text(bench)
print(cpu_summary)

# ---- results.md policies section
if not (root / "runs/bench/policies.json").exists():
    print("runs/bench/policies.json absent: docs/results.md left as it is")
    raise SystemExit(0)
pol = json.loads((root / "runs/bench/policies.json").read_text())
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
mkdir -p runs/bench
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
mkdir -p runs/bench
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
