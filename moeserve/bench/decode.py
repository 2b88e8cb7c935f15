"""``moeserve bench decode``: TPOT and prefill throughput against their bandwidth bounds.

For each buffer size (share of all experts), link setting and batch size, the engine decodes
``--new-tokens`` greedy tokens for a batch of seeded random prompts, ``--repeats`` (>= 3) times
after a warm-up run. TPOT is the mean decode-step time of a run (every sequence decodes in every
timed step; the prefill steps are not timed); the row reports the median over runs and the
spread (fastest and slowest run). With every expert resident the same prompts also run through
``transformers`` ``generate`` on the same device, dtype and thread setting.

Each row carries two lower bounds on a decode step (milliseconds): the **HBM bound** (bytes a
step must read from device memory at the device's memory bandwidth) and the **link bound** (bytes
moved host->device per step at the link's bandwidth); :mod:`moeserve.bench.decode_bounds` says
which bytes each counts.

A prefill row times one ``--prefill-len``-token prompt from admission to its first token (chunked
by ``--max-num-batched-tokens``), at every buffer size, with the same bounds over the prefill
steps (weights and experts read, KV written; bytes moved) and ``transformers``' forward pass on
the same prompt when every expert is resident.

Hit rate, blocking and bytes per token count decode steps only. With ``--expert-dtypes`` each
expert format (``--expert-dtype``: bf16, fp8, int8 ...) gets its own rows, its own expert bytes in
the bounds and in the bytes moved per token.

This module is the command: its flags, the checkpoint loaded once per expert format, the settings
and the output (JSON, or the table of :func:`moeserve.bench.render.render_decode`). The timed
runs and the rows are :mod:`moeserve.bench.decode_measure`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

import torch

from moeserve.bench.decode_bounds import Bounds, dense_read_bytes
from moeserve.bench.decode_measure import DecodeResult, PrefillResult, run_rows


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_compile_decode_arg, add_load_format_arg, add_model_arg

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
    add_load_format_arg(p)
    p.add_argument(
        "--expert-dtypes",
        default="auto",
        help="comma-separated --expert-dtype values, one set of rows each (e.g. bf16,fp8,int8: "
        "bytes moved per token side by side); the transformers baseline runs beside auto only",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument(
        "--expert-compute",
        default="device",
        choices=["device", "cpu", "auto"],
        help="where missed experts run (docs/hybrid.md; default: device, every miss copied over the "
        "link, which the link bound describes; moeserve bench hybrid compares the modes)",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--enforce-eager", action="store_true", help="no decode CUDA graphs (default: on, where they apply)"
    )
    add_compile_decode_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.errors import ConfigError
    from moe_runtime.loader import load_checkpoint
    from moe_runtime.paths import shown_path
    from moe_runtime.quant import EXPERT_DTYPES
    from moeserve.bench.hardware import h2d_gbps, hbm_gbps
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
        expert_compute=args.expert_compute,
        cuda_graphs=not args.enforce_eager,
        compile_decode=args.compile_decode,
        load_format=args.load_format,
    )
    device = base.torch_device
    hbm, hbm_source = hbm_gbps(device, args.hbm_gbps)
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    hf_model = None
    if not args.no_transformers:
        import transformers

        if args.load_format == "dummy":  # its own random weights, drawn on the device
            with torch.device(device):
                hf_model = transformers.AutoModelForCausalLM.from_config(
                    transformers.AutoConfig.from_pretrained(model_dir), dtype=base.torch_dtype
                )
        else:
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
        run_rows(args, base, loaded, b, baseline, device, fractions, batches, results, prefill)
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
        "expert_compute": args.expert_compute,
        "cuda_graphs": not args.enforce_eager,
        "compile_decode": args.compile_decode,
        "load_format": args.load_format,
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
        from moeserve.bench.render import render_decode

        print(render_decode({"settings": settings, "results": rows, "prefill": pre_rows}))
    return 0


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__
