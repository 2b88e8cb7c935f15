"""The measured rows of ``moeserve bench decode``: engine runs timed per buffer size, link and
batch (decode) and per buffer size (prefill), ``transformers``' times on the same prompts, and the
rows that put them beside their bounds (:mod:`moeserve.bench.decode_bounds`).

A decode run admits a batch of seeded random prompts, steps until every sequence has its first
token, then times each decode step (every sequence decodes in every timed step); a row is a
warm-up run and ``--repeats`` timed ones: the median run's TPOT and the spread. A prefill run
times one prompt from admission to its first token.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.bench.decode_bounds import Bounds, expert_read_bytes, kv_read_bytes


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
    cached_tokens: int = 0  # prompt tokens the timed runs took from the prefix cache (0: all computed)

    @property
    def ratio(self) -> float | None:
        return self.prefill_ms / self.transformers_prefill_ms if self.transformers_prefill_ms else None


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


def engine_prefill(engine, prompt: list[int]) -> tuple[float, int, int, int]:
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


def run_rows(args, base, loaded, b: Bounds, hf_model, device, fractions, batches, results, prefill) -> None:
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
                if engine.compiled is not None:
                    engine.capture_graphs()  # the compile, before the rows (as serve does at start)
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
                    prefill.append(prefill_row(args, engine, hf_model, device, b))


def prefill_row(args, engine, hf_model, device, b: Bounds) -> PrefillResult:
    """Time ``--prefill-len`` prompt tokens to the first token (warm-up + ``--repeats`` runs), each
    run a prompt of its own: a repeated one would come from the prefix cache, not be computed."""
    prompts = _prompts(engine.loaded.config.vocab_size, args.repeats + 1, args.prefill_len, args.seed + 1000)
    engine_prefill(engine, prompts[0])  # warm-up
    cached = engine.stats.prefix_cache_hits
    runs = [engine_prefill(engine, p) for p in prompts[1:]]
    cached = engine.stats.prefix_cache_hits - cached
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
        cached_tokens=cached,
    )
    if hf_model is not None and res.buffer_fraction == 1.0:
        res.transformers_prefill_ms = 1e3 * _transformers_prefill(hf_model, prompts[1], args.repeats, device)
    _progress(
        f"fraction={res.buffer_fraction} prefill {args.prefill_len} tokens: {res.tokens_per_s:.0f} tokens/s",
    )
    return res


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def asdict_rt(rt) -> dict:
    from dataclasses import fields

    return {f.name: getattr(rt, f.name) for f in fields(rt)}
