"""``moeserve bench decode``: TPOT and prefill throughput against their bandwidth bounds.

For each buffer size (share of all experts), link setting and batch size, the engine decodes
``--new-tokens`` greedy tokens for a batch of seeded random prompts, ``--repeats`` (>= 3) times
after a warm-up run. TPOT is the mean decode-step time of a run (every sequence decodes in every
timed step; the prefill steps are not timed); the row reports the median over runs and the
spread (fastest and slowest run). With every expert resident the same prompts also run through
``transformers`` ``generate`` on the same device, dtype and thread setting.

Each row carries two lower bounds on a decode step (milliseconds):

- **HBM bound**: bytes a step must read from device memory, at the device's memory bandwidth
  (:func:`moe_runtime.bench.hardware.hbm_gbps`: a data-sheet table by CUDA device name, a measured
  copy bandwidth on the CPU, or ``--hbm-gbps``). Bytes read = resident dense weights (the
  embedding table counts only as the LM head when tied; latent attention, shared experts and
  dense-first layers are dense weights) + every distinct expert the step used (measured lookups;
  gpt-oss' resident per-expert biases count with their expert, not as dense weights) + the KV cache
  of every sequence at its mean context length over the run (sliding-window layers at most their
  window; DeepSeek's latent cache row per layer).
- **Link bound**: bytes moved host->device per decode step (measured: demand + prefetch copies) at
  the link's bandwidth: measured in this run for copies of one expert (pinned, CUDA events; the
  fastest of 5) when no link is emulated, else the emulated ``link_gbps`` plus ``link_latency_us`` per copy.

A prefill row times one ``--prefill-len``-token prompt from admission to its first token (chunked
by ``--max-num-batched-tokens``), at every buffer size, with the same bounds over the prefill
steps (weights and experts read, KV written; bytes moved) and ``transformers``' forward pass on
the same prompt when every expert is resident.

Hit rate, blocking and bytes per token count decode steps only. With ``--expert-dtypes`` each
expert format (``--expert-dtype``: bf16, fp8, int8 ...) gets its own rows, its own expert bytes in
the bounds and in the bytes moved per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class DecodeResult:
    """One decode row. Times in ms; ``*_bytes_per_step`` are per decode step (all sequences)."""

    buffer_fraction: float
    buffer_slots: int
    link_gbps: float | None
    batch: int
    tpot_ms: float
    tpot_ms_min: float
    tpot_ms_max: float
    hit_rate: float
    blocking_ms_per_token: float
    bytes_per_token: float
    weight_bytes_per_step: float
    kv_bytes_per_step: float
    h2d_bytes_per_step: float
    hbm_bound_ms: float
    link_bound_ms: float
    expert_bytes_per_token: float = 0.0  # one token's routed experts: top-k x MoE layers x expert read
    transformers_tpot_ms: float | None = None
    transformers_tpot_ms_min: float | None = None
    transformers_tpot_ms_max: float | None = None
    cpu_ms: float | None = None  # process CPU time per decode step (all threads), median over runs
    expert_dtype: str = "auto"  # --expert-dtype of the row
    expert_bytes: int = 0  # bytes of one expert as stored and moved in that format

    @property
    def ratio(self) -> float | None:
        return self.tpot_ms / self.transformers_tpot_ms if self.transformers_tpot_ms else None


@dataclass
class PrefillResult:
    """One prefill row: ``prompt_tokens`` prompt tokens to the first token, batch 1. Times in ms."""

    buffer_fraction: float
    buffer_slots: int
    prompt_tokens: int
    prefill_ms: float
    prefill_ms_min: float
    prefill_ms_max: float
    tokens_per_s: float
    weight_bytes: float
    kv_bytes: float
    h2d_bytes: float
    hbm_bound_ms: float
    link_bound_ms: float
    transformers_prefill_ms: float | None = None
    expert_dtype: str = "auto"

    @property
    def ratio(self) -> float | None:
        return self.prefill_ms / self.transformers_prefill_ms if self.transformers_prefill_ms else None


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser("decode", help="TPOT and prefill vs buffer size and link, with HBM and link bounds")
    add_model_arg(p)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    p.add_argument("--fractions", default="1.0,0.5,0.25", help="buffer sizes as shares of all experts")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=0.5,
        help="emulated link for the 'link on' rows, GB/s; 0 = no such rows (default: 0.5)",
    )
    p.add_argument("--link-latency-us", type=float, default=10.0, help="emulated per-transfer latency")
    p.add_argument(
        "--hbm-gbps",
        type=float,
        default=None,
        help="device memory bandwidth for the HBM bound, GB/s (default: the data-sheet table on CUDA, "
        "a measured copy on the CPU)",
    )
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill row; 0 = none")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="prefill chunk (tokens per step)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row, >= 3 (default: 3)")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument(
        "--expert-dtypes",
        default="auto",
        help="comma-separated --expert-dtype values, one set of rows each (e.g. bf16,fp8,int8: "
        "bytes moved per token side by side); the transformers baseline runs beside auto only",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run)


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, length)).tolist()


@dataclass
class _Run:
    """One engine run: timed decode steps and the buffer counters over them."""

    tpot_s: float
    cpu_s: float  # process CPU time per step (compute and I/O threads)
    steps: int
    lookups: int
    hits: int
    blocking_s: float
    moved: int


def _delta(engine, before) -> tuple[int, int, float, int]:
    st = engine.buffer.stats
    return (
        st.total_lookups - before.total_lookups,
        st.total_hits - before.total_hits,
        st.total_blocking_s - before.total_blocking_s,
        (st.demand_bytes + st.prefetch_bytes) - (before.demand_bytes + before.prefetch_bytes),
    )


def _engine_decode(engine, prompts: list[list[int]], new_tokens: int) -> _Run:
    """Admit ``prompts``, step until each has its first token, then time the decode steps."""
    from moe_runtime.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = {f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))}
    for rid, p in zip(sorted(ids), prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while started != ids:
        started.update(o.request_id for o in engine.step())
    before = engine.buffer.stats.snapshot()
    times, cpu = [], 0.0
    while engine.has_unfinished():
        c0, t0 = time.process_time(), time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
    return _Run(sum(times) / len(times), cpu / len(times), len(times), *_delta(engine, before))


def _engine_prefill(engine, prompt: list[int]) -> tuple[float, int, int, int]:
    """Seconds from admitting ``prompt`` to its first token; prefill steps, lookups, bytes moved."""
    from moe_runtime.engine.request import SamplingParams

    before = engine.buffer.stats.snapshot()
    engine.add_request(
        f"prefill-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, ignore_eos=True)
    )
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    lookups, _, _, moved = _delta(engine, before)
    return seconds, steps, lookups, moved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _transformers_tpot(model, prompts, new_tokens: int, repeats: int, device) -> list[float]:
    """Per-run decode-step seconds of ``generate``: (time of n tokens - time of 1) / (n - 1)."""
    import transformers

    ids = torch.tensor(prompts, device=device)

    def gen(n: int) -> float:
        cfg = transformers.GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, generation_config=cfg, attention_mask=torch.ones_like(ids))
        _sync(device)
        return time.perf_counter() - t0

    gen(2)  # warm-up
    return [(gen(new_tokens) - gen(1)) / (new_tokens - 1) for _ in range(repeats)]


def _transformers_prefill(model, prompt: list[int], repeats: int, device) -> float:
    """Median seconds of one forward pass over ``prompt`` (with a KV cache, as ``generate`` runs it)."""
    ids = torch.tensor([prompt], device=device)

    def fwd() -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=True)
        _sync(device)
        return time.perf_counter() - t0

    fwd()  # warm-up
    return statistics.median(fwd() for _ in range(repeats))


@dataclass(frozen=True)
class Bounds:
    """What the bounds divide by. ``hbm_gbps``: device memory bandwidth; ``h2d_gbps``: measured
    host->device copies of one expert; ``link_latency_us``: emulated per-copy latency."""

    hbm_gbps: float
    h2d_gbps: float
    expert_bytes: int
    dense_read_bytes: int
    kv_bytes_per_token: int
    link_latency_us: float

    def hbm_ms(self, nbytes: float) -> float:
        """Milliseconds to read ``nbytes`` from device memory."""
        return 1e3 * nbytes / (self.hbm_gbps * 1e9)

    def link_ms(self, moved: float, link_gbps: float | None) -> float:
        """Milliseconds to move ``moved`` bytes host->device: measured bandwidth, or the emulated
        link (bandwidth plus latency per expert copy)."""
        if link_gbps is None:
            return 1e3 * moved / (self.h2d_gbps * 1e9)
        return 1e3 * moved / (link_gbps * 1e9) + (moved / self.expert_bytes) * self.link_latency_us * 1e-3


#: resident per-expert tensors (gpt-oss' expert biases): a step reads only the rows of the experts it uses
EXPERT_RESIDENT = ("expert_gate_up_bias", "expert_down_bias")


def _is_expert_resident(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_RESIDENT


def dense_read_bytes(dense: dict[str, torch.Tensor]) -> int:
    """Dense bytes a forward pass reads: all resident weights (attention, latent attention, norms,
    routers and their biases, shared experts, dense-first MLPs, LM head) but the embedding table,
    which is read as the LM head only when tied (no separate ``lm_head``), and the per-expert
    biases (:func:`expert_read_bytes` counts them with their expert)."""
    total = sum(t.numel() * t.element_size() for n, t in dense.items() if not _is_expert_resident(n))
    embed, head = dense.get("embed"), dense.get("lm_head")
    if embed is not None and head is not None and head.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def expert_read_bytes(loaded) -> int:
    """Bytes a step reads for one routed expert it uses: its packed weights
    (``store.expert_nbytes``) plus its rows of the resident per-expert biases (gpt-oss: ``2I + H``)."""
    cfg = loaded.config
    bias = sum(t.numel() * t.element_size() for n, t in loaded.dense.items() if _is_expert_resident(n))
    return loaded.store.expert_nbytes + bias // (cfg.num_moe_layers * cfg.num_experts)


def kv_read_bytes(cfg, context: float, kv_bytes_per_token: int) -> float:
    """KV bytes one sequence at ``context`` tokens reads in a decode step over all layers, from
    ``kv_bytes_per_token`` (one token, all layers): a sliding-window layer of ``cfg`` (gpt-oss)
    reads at most ``cfg.sliding_window`` tokens."""
    sliding = len(cfg.sliding_layers)
    window = min(context, cfg.sliding_window) if sliding else 0
    return kv_bytes_per_token / cfg.num_layers * ((cfg.num_layers - sliding) * context + sliding * window)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.bench.hardware import h2d_gbps, hbm_gbps
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.errors import ConfigError
    from moe_runtime.loader import load_checkpoint
    from moe_runtime.paths import shown_path
    from moe_runtime.quant import EXPERT_DTYPES
    from moeserve.commands.common import resolve_model

    if args.repeats < 3:
        raise ConfigError(f"--repeats {args.repeats}: must be >= 3 (median and spread of runs)")
    if args.new_tokens < 2:
        raise ConfigError(f"--new-tokens {args.new_tokens}: must be >= 2 (one timed decode step)")
    torch.set_num_threads(args.cpu_threads)
    model_dir = resolve_model(args)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        raise ConfigError(
            f"--batches {args.batches!r} / --fractions {args.fractions!r}: not numbers"
        ) from None
    expert_dtypes = args.expert_dtypes.split(",")
    for name in expert_dtypes:
        if name not in EXPERT_DTYPES:
            raise ConfigError(f"--expert-dtypes {name!r}: choose from {', '.join(EXPERT_DTYPES)}")
    base = RuntimeConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=max(batches),
        max_model_len=max(args.prompt_len + args.new_tokens, args.prefill_len + 1) + 8,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cpu_threads=args.cpu_threads,
    )
    device = base.torch_device
    hbm, hbm_source = hbm_gbps(device, args.hbm_gbps)
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    hf_model = None
    if not args.no_transformers:
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=base.torch_dtype)
        hf_model = hf_model.to(device).eval()

    results: list[DecodeResult] = []
    prefill: list[PrefillResult] = []
    all_bytes: dict[str, int] = {}
    for expert_dtype in expert_dtypes:
        base.expert_dtype = expert_dtype
        loaded = load_checkpoint(model_dir, base)
        cfg = loaded.config
        expert_bytes = all_bytes[expert_dtype] = loaded.store.expert_nbytes
        b = Bounds(
            hbm,
            h2d_gbps(device, expert_bytes),
            expert_bytes,
            dense_read_bytes(loaded.dense),
            cfg.num_layers * cfg.kv_elements_per_token * base.torch_dtype.itemsize,
            args.link_latency_us,
        )
        baseline = hf_model if expert_dtype == "auto" else None
        _run_rows(args, base, loaded, b, baseline, device, fractions, batches, results, prefill)
        del loaded
    expert_bytes = all_bytes[expert_dtypes[0]]
    settings = {
        "model": shown_path(model_dir),
        "architecture": cfg.architecture,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "top_k": cfg.top_k,
        "cpu_threads": args.cpu_threads,
        "experts": cfg.num_moe_layers * cfg.num_experts,
        "expert_bytes": expert_bytes,
        "expert_dtypes": all_bytes,
        "dense_read_bytes": b.dense_read_bytes,
        "kv_bytes_per_token": b.kv_bytes_per_token,
        "hbm_gbps": round(hbm, 1),
        "hbm_source": hbm_source,
        "h2d_gbps_measured": round(b.h2d_gbps, 2),
        "link_gbps": args.link_gbps or None,
        "link_latency_us": args.link_latency_us,
        "prefetch_policy": base.prefetch_policy,
        "cache_policy": base.cache_policy,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_len": args.prefill_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "repeats": args.repeats,
        "warmup": f"1 run of {args.new_tokens} tokens per row (decode), 1 prompt (prefill)",
        "load_avg_1min": round(load_avg, 2) if load_avg is not None else None,
        "torch": torch.__version__,
        "transformers": _transformers_version(),
    }
    rows = [{**asdict(r), "ratio_vs_transformers": r.ratio} for r in results]
    pre_rows = [{**asdict(r), "ratio_vs_transformers": r.ratio} for r in prefill]
    if args.json:
        print(json.dumps({"settings": settings, "results": rows, "prefill": pre_rows}, indent=2))
    else:
        from moe_runtime.bench.render import render_decode

        print(render_decode({"settings": settings, "results": rows, "prefill": pre_rows}))
    return 0


def _run_rows(args, base, loaded, b: Bounds, hf_model, device, fractions, batches, results, prefill) -> None:
    """The decode (and prefill) rows of one expert format: every buffer fraction, link and batch."""
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine

    cfg, expert_bytes = loaded.config, b.expert_bytes
    links = [None] + ([args.link_gbps] if args.link_gbps else [])
    for fraction in fractions:
        for link in links:
            rt = RuntimeConfig(
                **{
                    **asdict_rt(base),
                    "buffer_fraction": fraction,
                    "link_gbps": link,
                    "link_latency_us": args.link_latency_us if link else 0.0,
                }
            )
            with LLMEngine(loaded, rt) as engine:
                for batch in batches:
                    prompts = _prompts(cfg.vocab_size, batch, args.prompt_len, args.seed + batch)
                    # warm-up as long as a timed run: the first engine's first short runs were slower
                    _engine_decode(engine, prompts, args.new_tokens)
                    runs = [_engine_decode(engine, prompts, args.new_tokens) for _ in range(args.repeats)]
                    steps = sum(r.steps for r in runs)
                    lookups = sum(r.lookups for r in runs)
                    moved = sum(r.moved for r in runs)
                    mean_context = args.prompt_len + args.new_tokens / 2  # decode step j reads prompt + j
                    weight = b.dense_read_bytes + lookups / steps * expert_read_bytes(loaded)
                    kv = batch * kv_read_bytes(cfg, mean_context, b.kv_bytes_per_token)
                    tpots = [1e3 * r.tpot_s for r in runs]
                    res = DecodeResult(
                        fraction,
                        engine.buffer.num_slots,
                        link,
                        batch,
                        statistics.median(tpots),
                        min(tpots),
                        max(tpots),
                        sum(r.hits for r in runs) / lookups if lookups else 0.0,
                        1e3 * sum(r.blocking_s for r in runs) / (steps * batch),
                        moved / (steps * batch),
                        weight,
                        kv,
                        moved / steps,
                        b.hbm_ms(weight + kv),
                        b.link_ms(moved / steps, link),
                        cpu_ms=statistics.median(1e3 * r.cpu_s for r in runs),
                        expert_dtype=base.expert_dtype,
                        expert_bytes=expert_bytes,
                    )
                    res.expert_bytes_per_token = cfg.top_k * cfg.num_moe_layers * expert_read_bytes(loaded)
                    if hf_model is not None and fraction == 1.0 and link is None:
                        hf = [
                            1e3 * s
                            for s in _transformers_tpot(
                                hf_model, prompts, args.new_tokens, args.repeats, device
                            )
                        ]
                        res.transformers_tpot_ms = statistics.median(hf)
                        res.transformers_tpot_ms_min, res.transformers_tpot_ms_max = min(hf), max(hf)
                    results.append(res)
                    _progress(
                        f"experts={base.expert_dtype} fraction={fraction} link={link} batch={batch}: "
                        f"tpot={res.tpot_ms:.2f} ms"
                    )
                if args.prefill_len and link is None:
                    prefill.append(_prefill_row(args, engine, hf_model, device, b))


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def _prefill_row(args, engine, hf_model, device, b: Bounds) -> PrefillResult:
    """Time ``--prefill-len`` prompt tokens to the first token (warm-up + ``--repeats`` runs)."""
    prompt = _prompts(engine.loaded.config.vocab_size, 1, args.prefill_len, args.seed + 1000)[0]
    _engine_prefill(engine, prompt)  # warm-up
    runs = [_engine_prefill(engine, prompt) for _ in range(args.repeats)]
    secs = [r[0] for r in runs]
    steps, lookups, moved = (statistics.median(r[i] for r in runs) for i in (1, 2, 3))
    weight = steps * b.dense_read_bytes + lookups * expert_read_bytes(engine.loaded)
    kv = args.prefill_len * b.kv_bytes_per_token
    med = statistics.median(secs)
    res = PrefillResult(
        engine.runtime.buffer_fraction,
        engine.buffer.num_slots,
        args.prefill_len,
        1e3 * med,
        1e3 * min(secs),
        1e3 * max(secs),
        args.prefill_len / med,
        weight,
        kv,
        moved,
        b.hbm_ms(weight + kv),
        b.link_ms(moved, None),
        expert_dtype=engine.runtime.expert_dtype,
    )
    if hf_model is not None and res.buffer_fraction == 1.0:
        res.transformers_prefill_ms = 1e3 * _transformers_prefill(hf_model, prompt, args.repeats, device)
    _progress(
        f"fraction={res.buffer_fraction} prefill {args.prefill_len} tokens: {res.tokens_per_s:.0f} tokens/s",
    )
    return res


def asdict_rt(rt) -> dict:
    from dataclasses import fields

    return {f.name: getattr(rt, f.name) for f in fields(rt)}
