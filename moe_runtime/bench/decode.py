"""``moeserve bench decode``: TPOT at batch 1 and 8 across buffer sizes and link settings.

For each buffer size (share of all experts), link setting and batch size, the engine decodes
``--new-tokens`` greedy tokens for a batch of seeded random prompts, ``--repeats`` times after a
warm-up; TPOT is the mean decode-step time of a run (every sequence decodes in every step), and
the reported figure is the median over runs. With every expert resident the same prompts also run
through ``transformers`` ``generate`` in the same process and thread setting, and the ratio
ours / transformers is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class DecodeResult:
    buffer_fraction: float
    buffer_slots: int
    link_gbps: float | None
    batch: int
    tpot_ms: float
    hit_rate: float
    blocking_ms_per_token: float
    bytes_per_token: float
    transformers_tpot_ms: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.tpot_ms / self.transformers_tpot_ms if self.transformers_tpot_ms else None


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser("decode", help="TPOT vs buffer size and link bandwidth (batch 1 and 8)")
    add_model_arg(p)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    p.add_argument("--fractions", default="1.0,0.5,0.25", help="buffer sizes as shares of all experts")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=0.5,
        help="emulated link for the 'link on' rows, GB/s (default: 0.5)",
    )
    p.add_argument("--link-latency-us", type=float, default=10.0, help="emulated per-transfer latency")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run)


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, length)).tolist()


def _engine_tpot(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from moe_runtime.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    engine.step()  # prefill + first token
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def _transformers_tpot(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    import transformers

    ids = torch.tensor(prompts)

    def gen(n: int) -> float:
        cfg = transformers.GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, generation_config=cfg, attention_mask=torch.ones_like(ids))
        return time.perf_counter() - t0

    gen(2)  # warm-up
    runs = [(gen(new_tokens) - gen(1)) / (new_tokens - 1) for _ in range(repeats)]
    return statistics.median(runs)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.loader import load_checkpoint
    from moeserve.commands.common import resolve_model

    torch.set_num_threads(args.cpu_threads)
    model_dir = resolve_model(args)
    batches = [int(b) for b in args.batches.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    base = RuntimeConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=max(batches),
        max_model_len=args.prompt_len + args.new_tokens + 8,
        cpu_threads=args.cpu_threads,
    )
    loaded = load_checkpoint(model_dir, base)
    cfg = loaded.config
    results: list[DecodeResult] = []
    hf_model = None
    if not args.no_transformers:
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=base.torch_dtype).eval()
    for fraction in fractions:
        for link in (None, args.link_gbps):
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
                    _engine_tpot(engine, prompts, 4)  # warm-up
                    st0 = engine.buffer.stats.snapshot()
                    tpots = [_engine_tpot(engine, prompts, args.new_tokens) for _ in range(args.repeats)]
                    st1 = engine.buffer.stats
                    tokens = args.repeats * batch * args.new_tokens
                    lookups = st1.total_lookups - st0.total_lookups
                    hits = st1.total_hits - st0.total_hits
                    moved = (st1.demand_bytes + st1.prefetch_bytes) - (st0.demand_bytes + st0.prefetch_bytes)
                    res = DecodeResult(
                        fraction,
                        engine.buffer.num_slots,
                        link,
                        batch,
                        1e3 * statistics.median(tpots),
                        hits / lookups if lookups else 0.0,
                        1e3 * (st1.total_blocking_s - st0.total_blocking_s) / tokens,
                        moved / tokens,
                    )
                    if hf_model is not None and fraction == 1.0 and link is None:
                        res.transformers_tpot_ms = 1e3 * _transformers_tpot(
                            hf_model, prompts, args.new_tokens, args.repeats
                        )
                    results.append(res)
                    if not args.json:
                        print(
                            f"  fraction={fraction} link={link} batch={batch}: tpot={res.tpot_ms:.2f} ms",
                            file=sys.stderr,
                        )
    settings = {
        "model": str(model_dir),
        "architecture": cfg.architecture,
        "device": args.device,
        "dtype": args.dtype,
        "cpu_threads": args.cpu_threads,
        "experts": cfg.num_moe_layers * cfg.num_experts,
        "expert_bytes": loaded.store.expert_nbytes,
        "link_gbps": args.link_gbps,
        "link_latency_us": args.link_latency_us,
        "prefetch_policy": base.prefetch_policy,
        "cache_policy": base.cache_policy,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "warmup": "1 run of 4 tokens",
        "torch": torch.__version__,
    }
    rows = [{**asdict(r), "ratio_vs_transformers": r.ratio} for r in results]
    if args.json:
        print(json.dumps({"settings": settings, "results": rows}, indent=2))
    else:
        _print_table(settings, results)
    return 0


def asdict_rt(rt) -> dict:
    from dataclasses import fields

    return {f.name: getattr(rt, f.name) for f in fields(rt)}


def _print_table(settings: dict, results: list[DecodeResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="moeserve bench decode (TPOT, median of runs)")
    for col in (
        "buffer",
        "slots",
        "link GB/s",
        "batch",
        "TPOT ms",
        "hit",
        "block ms/tok",
        "KiB/tok",
        "HF ms",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            f"{r.buffer_fraction:.0%}",
            str(r.buffer_slots),
            str(r.link_gbps or "off"),
            str(r.batch),
            f"{r.tpot_ms:.2f}",
            f"{r.hit_rate:.3f}",
            f"{r.blocking_ms_per_token:.3f}",
            f"{r.bytes_per_token / 1024:.1f}",
            f"{r.transformers_tpot_ms:.2f}" if r.transformers_tpot_ms else "",
            f"{r.ratio:.2f}" if r.ratio else "",
        )
    console = Console()
    console.print(table)
    console.print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
