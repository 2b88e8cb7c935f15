"""Regenerate docs/benchmarks.md and the policies section of docs/results.md from bench JSON.

Run after ``moeserve bench decode --json > runs/bench/decode.json`` (this machine's CPU run; every
``runs/bench/decode-cpu-*.json`` of the real-width commands in :data:`CPU_RUNS` and every
``runs/bench/decode-cuda-*.json`` of the GPU session routine get a section each) and, for
docs/results.md, ``moeserve bench policies --json > runs/bench/policies.json`` (skipped when that
file is absent; ``tools/update_results_docs.py`` writes that section alone, without decode.json). The tables come from ``moeserve bench render``; the summaries and comparisons are
computed from the same files.

``--gpu-only`` rewrites only the "Other devices" section (every ``runs/bench/decode-cuda-*.json``
and, verbatim, every ``runs/bench/replay-cuda-*.txt`` of ``tools/gpu_routine.sh``) and the GPU
session routine, leaving the CPU sections as they are: for a session that ran only the routine.
"""

import json
import runpy
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))
from moeserve.checkpoints.shapes import SHAPES, shrunk  # noqa: E402

#: CPU decode benches at real per-layer widths: (shape, layers kept, width divisor, transformers
#: baseline). deepseek-v3's MoE layer is 23 GB in bf16, more than this 24 GiB machine holds twice
#: (written, then loaded), so its widths are halved; glm-4.5-air skips transformers' second copy.
CPU_RUNS = [
    ("deepseek-v2-lite", 3, 1, True),
    ("deepseek-v3", 4, 2, False),
    ("glm-4.5-air", 2, 1, False),
    ("gpt-oss-20b", 2, 1, True),
    ("phi-3.5-moe", 1, 1, True),
]
CPU_BENCH = (
    "--dtype bf16 --fractions 1.0,0.25 --batches 1,4 --link-gbps 0 --prompt-len 16 --new-tokens 8 "
    "--prefill-len 64"
)

GPU_ONLY = "--gpu-only" in sys.argv[1:]
if {"-h", "--help"} & set(sys.argv[1:]):
    print(__doc__)
    sys.exit(0)
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


def layers_text(n: int) -> str:
    return f"{n} layer{'s' if n != 1 else ''}"


def other_runs(pattern: str, none: str) -> str:
    """A section per ``runs/bench/<pattern>`` file: title, summary, rendered tables."""
    parts = []
    for path in sorted((root / "runs/bench").glob(pattern)):
        data = json.loads(path.read_text())
        st = data["settings"]
        rel = path.relative_to(root)
        device = "CPU (this machine)" if st["device_name"] == "cpu" else st["device_name"]
        per_token = data["results"][0].get("expert_bytes_per_token")
        per_token = (
            f" One token's routed experts (top-{st['top_k']} in each MoE layer, with their biases): "
            f"{per_token / 1e6:.1f} MB."
            if per_token
            else ""
        )
        parts.append(
            f"### {device}: {st['architecture']}, {layers_text(st['layers'])}, hidden {st['hidden']}, "
            f"{st['experts']} experts of {st['expert_bytes'] / 2**20:.2f} MiB, {st['dtype']} (`{rel.name}`)\n\n"
            f"{summary(data)}.{per_token}\n\n{render(str(rel))}\n"
        )
    return "\n".join(parts) or f"{none}\n"


def replays(pattern: str) -> str:
    """Each ``runs/bench/<pattern>`` (``moeserve replay``'s printed summary) verbatim, titled by
    its file name."""
    parts = []
    for path in sorted((root / "runs/bench").glob(pattern)):
        parts.append(f"#### `{path.name}`\n\n```\n{path.read_text().rstrip()}\n```\n")
    return "\n".join(parts)


def other_devices() -> str:
    """The "Other devices" section: every GPU decode JSON, then every GPU serving replay."""
    runs = other_runs(
        "decode-cuda-*.json",
        "None recorded yet: a session with a lent GPU records them with the routine below.",
    )
    serving = replays("replay-cuda-*.txt")
    if serving:
        serving = (
            "\n### Serving replays on a GPU\n\n"
            "`tools/gpu_routine.sh` serves the Qwen3-30B-A3B shape (8 layers, bf16) and replays the\n"
            "Azure conversation trace against it (`--rps 2 --trace-offset 60 --duration 60\n"
            "--max-tokens-cap 64`: 101 requests, 1.67 req/s offered), all resident and at a 25% buffer\n"
            "(`--buffer-fraction`, in the file name). Each summary's first line gives its own settings:\n"
            "a run at `trace_offset_s=0.0` had the trace's first minute, which offers 0.59 req/s.\n"
            "`moeserve replay` printed:\n\n" + serving
        )
    return f"""## Other devices

Every `runs/bench/decode-cuda-*.json` (the GPU session routine below writes them), rendered the
same way; the file name ends with the commit the run was made at. Runs on different machines
(or calls) of the same kind differ in host speed, and a decode step on a GPU is mostly host time:
compare each row's ratio to transformers, measured in the same run, rather than TPOT across runs.
In `tools/gpu_routine.sh` the Qwen3 rows run while the Mixtral checkpoint is still being written
(`load_avg_1min` in their settings).

{runs}{serving}"""


def cpu_commands() -> str:
    """The make-checkpoint and bench commands of :data:`CPU_RUNS`, each with its checkpoint size."""
    lines = ["mkdir -p runs/bench"]
    for name, layers, shrink, hf in CPU_RUNS:
        s = shrunk(SHAPES[name], shrink)
        tag = f"{name}{'-half' if shrink == 2 else ''}-{layers}l"
        widths = (
            "real widths" if shrink == 1 else f"widths / {shrink}, expert {s.expert_bytes(2) / 2**20:.0f} MiB"
        )
        lines += [
            f"# {name}: {layers_text(layers)}, {widths}, {s.checkpoint_bytes(layers, 2) / 1e9:.1f} GB in bf16",
            f"moeserve make-checkpoint --shape {name} --layers {layers} --out runs/ckpt/{tag}"
            + (f" --shrink {shrink}" if shrink > 1 else ""),
            f"moeserve bench decode --model runs/ckpt/{tag} {CPU_BENCH}{'' if hf else ' --no-transformers'} "
            f"--json > runs/bench/decode-cpu-{tag}.json",
        ]
    return "\n".join(lines)


def extras(s) -> str:
    x = s.extra
    parts = [f"qk-norm ({s.qk_norm})"] if s.qk_norm != "none" else []
    parts += (
        [f"MLA (kv rank {x['kv_lora_rank']}, q rank {x['q_lora_rank'] or '-'})"]
        if "kv_lora_rank" in x
        else []
    )
    parts += [f"{s.first_dense} dense layers first (width {s.dense_intermediate})"] if s.first_dense else []
    parts += [f"shared expert {s.shared_intermediate}"] if s.shared_intermediate else []
    parts += [f"{x['n_group']} expert groups, {x['topk_group']} used"] if x.get("n_group", 1) > 1 else []
    parts += [f"RoPE on {x['partial_rotary_factor']:g} of the head"] if "partial_rotary_factor" in x else []
    parts += [f"sliding window {x['sliding_window']}"] if "layer_types" in x else []
    rope = x.get("rope_parameters", {}).get("rope_type")
    parts += [rope] if rope else []
    parts += ["LayerNorm, lm_head bias"] if x.get("lm_head_bias") else []
    return ", ".join(parts + (["qkv bias"] if s.attention_bias else []))


shape_rows = "\n".join(
    f"| `{s.name}` | {s.num_layers} | {s.hidden} | {s.heads} / {s.kv_heads} x {s.head_dim} | {s.experts} | "
    f"{s.top_k} | {s.moe_intermediate} | {s.expert_bytes(2) / 2**20:.2f} | "
    f"{s.experts * s.expert_bytes(2) / 1e9:.2f} | {2 * s.layer_params(s.num_layers - 1) / 1e9:.2f} | "
    f"{s.checkpoint_bytes(s.num_layers, 2) / 1e9:.1f} | {s.vocab} | {extras(s)} | {s.source} |"
    for s in SHAPES.values()
)
mix, qwen3 = SHAPES["mixtral-8x7b"], SHAPES["qwen3-30b-a3b"]
gb = lambda s, n: f"{s.checkpoint_bytes(n, 2) / 1e9:.1f} GB"


def routine() -> str:
    """The "GPU session routine" section (the end of the file)."""
    return f"""## GPU session routine

Whenever `status` of the device tool shows a GPU lent (`can_start_another` true), a session runs
the following. Everything a command writes under `$OUT` on the GPU machine comes back.

1. Here, from the project root: mark the start, fetch the wheels the GPU machine lacks (into
   `.whl/`), and copy the replay's trace and prompts into `.gpu/` (the device tool sends the
   checkout alone, not `../shared`); both folders are git-ignored.

   ```bash
   mkdir -p runs/bench .gpu && touch runs/bench/gpu-routine.start && ../shared/tools/gpu-wheels.sh llguidance threadpoolctl
   grep -qx /.gpu/ .git/info/exclude || echo /.gpu/ >> .git/info/exclude
   cp ../shared/data/arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv ../shared/data/prompts/prompts_combined.jsonl .gpu/
   ```

2. Run `bash tools/gpu_routine.sh` with the device tool's `run`, `carry: [".whl", ".gpu"]` and
   `timeout_s: 600` (about 500 s on an H100, most of it writing the two checkpoints). It runs the
   GPU tests, then `moeserve bench decode --device cuda --dtype bf16 --link-gbps 0
   --prefill-len 2048` on the bundled model, the Qwen3-30B-A3B shape with 8 layers ({gb(qwen3, 8)})
   and the Mixtral-8x7B shape with 4 layers ({gb(mix, 4)}) at buffers of 100% and 25%, and the
   serving replay above against the Qwen3 shape, all resident (then at 25% where time is left).

3. Here: copy what came back (the device tool puts a run's files under `/work/.device/`) into
   `runs/bench/`, each name ending with the commit the run was made at, and regenerate the
   "Other devices" section.

   ```bash
   c=$(git rev-parse --short HEAD); for f in $(find /work/.device -name 'decode-cuda-*.json' -newer runs/bench/gpu-routine.start); do cp $f runs/bench/$(basename $f .json)-at-$c.json; done
   for f in $(find /work/.device -name 'replay-cuda-*.txt' -newer runs/bench/gpu-routine.start); do cp $f runs/bench/$(basename $f .txt)-at-$c.txt; done
   python tools/update_bench_docs.py --gpu-only
   ```

   `runs/` is git-ignored. Commit the regenerated `docs/benchmarks.md`, and say which device the
   figures came from. The tool names the device in each section title; `gpu-tests.log` and
   `log.txt` (checkpoint times, each step's exit status) come back beside the JSON.
"""


# ---- benchmarks.md
if GPU_ONLY:  # only the GPU section changes: the CPU JSONs of the other sections need not be here
    path = root / "docs/benchmarks.md"
    text = path.read_text()
    start, end = text.index("## Other devices\n"), text.index("## Real-shape checkpoints")
    text = text[:start] + other_devices() + text[end:]
    path.write_text(text[: text.index("## GPU session routine")] + routine())
    sys.exit(0)
dec = json.loads((root / "runs/bench/decode.json").read_text())
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
- **HBM bound**: bytes a step reads from device memory (resident dense weights: attention or
  DeepSeek's latent attention, norms, routers and their biases, shared experts, dense-first
  layers' MLPs, the LM head, the embedding table only as a tied LM head; every distinct expert
  the step used, from the buffer's lookups, with its rows of gpt-oss' resident expert biases;
  the KV cache at the run's mean context, at most the window in gpt-oss' sliding layers, the
  latent row per layer for DeepSeek) / the device's memory bandwidth: `hbm_gbps` in the
  settings, from the data-sheet table of `moeserve/bench/hardware.py` on CUDA (it reuses the
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
  I/O thread. The runtime's `eam` measures whether its prefetching pays (blocking saved against
  its planning host time, `ModeTrial` in `docs/architecture.md`) and runs as caching alone or
  as on-demand + LRU where it does not, so such rows may move few prefetched experts.
- `--cpu-threads 1` is the default: on this machine 2 intra-op threads made small-expert steps
  several times slower under load (see `docs/architecture.md`).
- Whether a change made these rows slower is measured in one run against the older commit, with
  the two trees' workers interleaved: `docs/bench-regression.md`, written by
  `python tools/bench_regression.py --base COMMIT --out docs/bench-regression.md`.

`expert_bytes_per_token` in each JSON row is what one token's routed experts weigh: top-k experts
in each MoE layer x MoE layers x one expert with its resident biases (at batch 1 a step reads
exactly that beside the dense weights).

## Real-width layers of the new families on this CPU

`moeserve bench decode` on checkpoints made with the real per-layer shapes of DeepSeek-V2-Lite,
DeepSeek-V3, GLM-4.5-Air, gpt-oss-20b and Phi-3.5-MoE (section below), keeping a few layers:
each family's dense-first layers and at least one MoE layer. CPU results only (this project's
2-core machine, shared with other work, so the times are noisy; no GPU), bf16, every expert
resident and a 25% buffer, batches 1 and 4. Each pair of commands writes the checkpoint size
shown and takes minutes; the bench holds the checkpoint in memory (twice with the transformers
baseline), so it needs that much free RAM. DeepSeek-V3's MoE layer alone is
{2 * SHAPES["deepseek-v3"].layer_params(3) / 1e9:.1f} GB in bf16, more than this 24 GiB machine can write and load,
so its run halves every width (the hidden `--shrink 2` of `make-checkpoint`: a quarter of the
expert bytes); GLM-4.5-Air runs without the transformers baseline for the same reason.

```bash
{cpu_commands()}
python tools/update_bench_docs.py   # renders each JSON below
```

{other_runs("decode-cpu-*.json", "None recorded yet: run the commands above.")}
{other_devices()}
## Real-shape checkpoints (`moeserve make-checkpoint`)

`moeserve make-checkpoint --shape NAME --layers N --out DIR [--dtype bf16|fp16|fp32] [--seed S]`
writes a random-weight Hugging Face checkpoint with the real per-layer shapes of a published MoE
model, keeping its first `N` decoder layers. Both `transformers` (`from_pretrained`) and moeserve
(`--model DIR`) load it. The shapes (`moeserve/checkpoints/shapes.py`; sizes in bf16; "MoE
layer GB": one MoE decoder layer with its attention and norms, "model GB": the whole model,
`RealShape.checkpoint_bytes`, which counts what transformers' model of the shape holds):

| shape | layers | hidden | heads / KV heads x head dim | experts | top-k | expert width | expert MiB | experts GB per layer | MoE layer GB | model GB | vocab | extras | source |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{shape_rows}

- It is written one decoder layer at a time, one safetensors shard per layer plus one for the
  embeddings, final norm and LM head, with `model.safetensors.index.json`. The model is built by
  `transformers` on the `meta` device, and each shard's tensor names and layout come from
  `transformers`' own save conversion. So peak memory is one layer, not the model.
- Weights are `N(0, 0.02)`, norms 1, biases 0. Routers are `N(0, 3 / sqrt(hidden))`, so router
  logits of a unit-RMS hidden state have std 3. Routing then depends on the input and is far from
  uniform. The command prints the first MoE layer's routing of 64 random tokens: its softmax
  entropy as a share of uniform's (the tests require it below 0.8), and how many distinct top-k
  sets it saw.
- Family fields (DeepSeek's latent-attention ranks, YaRN and grouped routing, dense-first
  layers, GLM-4.5's partial RoPE, gpt-oss' alternating sliding window, Phi-3.5-MoE's LongRoPE)
  come from the same config files. `--layers` must keep at least one MoE layer
  (`deepseek-v3`: 4 or more). `phi-3.5-moe` uses LongRoPE factors of 1.0, not the published
  lists (equal sizes and cost, different positions' angles). moeserve and transformers load
  every one.
- The tokenizer is the bundled model's byte-level BPE, padded to the model's `vocab_size` with
  `<|reserved_N|>` entries that no merge produces. Every id a model emits decodes. EOS and padding
  are `<|endoftext|>` = 0, not the real models' ids.
- Example: `moeserve make-checkpoint --shape mixtral-8x7b --layers 4 --out runs/ckpt/mixtral-4l`
  writes {gb(mix, 4)} in bf16; `qwen3-30b-a3b` with 8 layers writes {gb(qwen3, 8)}. Check the disk
  first.

{routine()}"""
(root / "docs/benchmarks.md").write_text(bench)
print(cpu_summary)

# ---- results.md policies section: its own tool, which needs no decode.json
runpy.run_path(str(root / "tools/update_results_docs.py"), run_name="__main__")
