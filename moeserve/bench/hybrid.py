"""``moeserve bench hybrid``: decode TPOT by ``--expert-compute`` mode, and the cost model's error.

One checkpoint is loaded once; one engine per mode (``device``, ``cpu``, ``auto``: hybrid expert
execution, :mod:`moe_runtime.hybrid`) shares it, at one buffer size and emulated link. A run
admits ``--batch`` fresh random prompts (seeded per run, so the cache does not meet the routing it
was warmed on), steps until each has its first token, then times every decode step; TPOT is the
run's mean step time. After one warm-up run per mode, the ``--repeats`` timed runs go round the
modes in turn (run ``r`` of every mode under the same host load), each mode's row reporting the
median run and the spread (fastest and slowest), the buffer hit rate, the misses computed on the
CPU and the bytes copied per token, and, for the hybrid modes, the placement's predicted layer
time against the measured one over the timed runs' layer runs
(:meth:`~moe_runtime.hybrid.placement.HybridPlacer.prediction_error`: median of
``|predicted - measured| / measured``) with the cost model's fits.

Beside TPOT each row gives the hybrid bound of its misses, the limit for the missed experts
alone: their bytes per token over the link and host memory at once, ``misses x expert bytes /
(link GB/s + host GB/s)``, the link's rate emulated or timed by the I/O threads, the host's
the CPU pool's kernel at one row as measured at load (the resident experts' compute comes on top).

On a CPU device (the link emulated) each row also gives the **step floor**: every byte a decode
step reads, the dense weights and each expert it uses once, at the read roof of all the host's
cores (``bench cpu-experts``' roof, measured before the rows). There the "device" computes on the
same cores and reads the same memory as the CPU pool, so no placement runs a step faster than
that; the hybrid modes can only stop paying for copies.
``--prefill-len N`` also times one N-token prompt per round and mode, admission to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from moe_runtime.errors import ConfigError


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_load_format_arg, add_model_arg

    p = sub.add_parser("hybrid", help="decode TPOT by --expert-compute mode, and the cost model's error")
    add_model_arg(p)
    p.add_argument(
        "--modes", default="device,auto", help="comma list of device, cpu, auto (default: device,auto)"
    )
    p.add_argument(
        "--buffer-fraction", type=float, default=0.25, help="buffer share of all experts (default 0.25)"
    )
    p.add_argument("--link-gbps", type=float, default=4.0, help="emulated link, GB/s (default: 4)")
    p.add_argument("--link-latency-us", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--prefill-len", type=int, default=0,
        help="also time one prompt of this many tokens per round, admission to first token (0: off)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode, >= 3 (default: 3)")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    add_load_format_arg(p)
    p.add_argument("--expert-dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--cpu-expert-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=run)


def _run(engine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """One run: admit ``prompts``, step to their first tokens, time the decode steps."""
    from moe_runtime.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = {f"hy-{time.monotonic_ns()}-{i}" for i in range(len(prompts))}
    for rid, p in zip(sorted(ids), prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while started != ids:
        started.update(o.request_id for o in engine.step())
    st = engine.buffer.stats
    before = (st.total_lookups, st.total_hits, sum(st.cpu_experts), st.demand_bytes + st.prefetch_bytes)
    placer = engine.hybrid
    first = len(placer.records) if placer is not None else 0
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    after = (st.total_lookups, st.total_hits, sum(st.cpu_experts), st.demand_bytes + st.prefetch_bytes)
    lookups, hits, cpu, moved = (a - b for a, b in zip(after, before))
    steps = len(times)
    errors = []
    if placer is not None:
        placer.prediction_error()  # folds in the last layer run
        errors = [abs(r.predicted_s - r.measured_s) / r.measured_s for r in list(placer.records)[first:]]
    return {
        "tpot_s": sum(times) / steps, "steps": steps, "lookups": lookups, "hits": hits,
        "cpu_experts": cpu, "moved": moved, "errors": errors,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import EXPERT_COMPUTE_MODES, RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.loader import load_checkpoint
    from moe_runtime.paths import shown_path
    from moeserve.bench.decode_measure import engine_prefill
    from moeserve.bench.experts import _cpu_name
    from moeserve.bench.policy_summary import spread
    from moeserve.commands.common import resolve_model

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in EXPERT_COMPUTE_MODES:
            raise ConfigError(f"--modes: {m!r} is not one of {', '.join(EXPERT_COMPUTE_MODES)}")
    if args.repeats < 3:
        raise ConfigError(f"--repeats {args.repeats}: must be >= 3 (median and spread of runs)")
    if args.prefill_len < 0:
        raise ConfigError(f"--prefill-len {args.prefill_len}: must be >= 0")
    torch.set_num_threads(args.cpu_threads)
    model_dir = resolve_model(args)
    base = RuntimeConfig(
        device=args.device, dtype=args.dtype, expert_dtype=args.expert_dtype,
        buffer_fraction=args.buffer_fraction, link_gbps=args.link_gbps or None,
        link_latency_us=args.link_latency_us, max_batch_size=args.batch,
        max_model_len=max(args.prompt_len + args.new_tokens, args.prefill_len + 1) + 8,
        cpu_threads=args.cpu_threads,
        cpu_expert_threads=args.cpu_expert_threads, load_format=args.load_format,
    )  # fmt: skip
    loaded = load_checkpoint(model_dir, base)
    vocab = loaded.config.vocab_size
    roof_gbps = _all_core_roof() if torch.device(args.device).type == "cpu" else None
    engines = {}
    for m in modes:
        rt = RuntimeConfig(**{**{f.name: getattr(base, f.name) for f in fields(base)}, "expert_compute": m})
        engines[m] = LLMEngine(loaded, rt)
    rng = np.random.default_rng(args.seed)

    def prompts() -> list[list[int]]:
        return rng.integers(0, vocab, size=(args.batch, args.prompt_len)).tolist()

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    prefills: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for m in modes:  # warm-up
            _run(engines[m], prompts(), args.new_tokens)
        for _ in range(args.repeats):
            ps = prompts()  # the same prompts for every mode in this round
            long = rng.integers(0, vocab, size=args.prefill_len).tolist() if args.prefill_len else None
            for m in modes:
                runs[m].append(_run(engines[m], ps, args.new_tokens))
                if long is not None:
                    prefills[m].append(engine_prefill(engines[m], long)[0])
        summaries = {m: engines[m].summary() for m in modes}
        fits = {m: _fits(engines[m].hybrid) for m in modes}
    finally:
        for e in engines.values():
            e.close()
    rows = [_row(m, runs[m], fits[m], args.batch) for m in modes]
    link_gbps, host_gbps = _rates(args.link_gbps, fits, loaded.store.expert_nbytes)
    for r in rows:
        if prefills[r["mode"]]:
            ms = spread([1e3 * t for t in prefills[r["mode"]]])
            r.update(zip(("prefill_ms", "prefill_ms_min", "prefill_ms_max"), ms))
        # the misses' bytes over both paths at once (link and host memory): the hybrid bound of
        # the missed experts alone (the resident ones' compute comes on top)
        r["hybrid_bound_ms"] = (
            None if link_gbps is None or host_gbps is None
            else r["misses_per_token"] * loaded.store.expert_nbytes / ((link_gbps + host_gbps) * 1e9) * 1e3
        )  # fmt: skip
        r["step_floor_ms"] = None if roof_gbps is None else _floor_ms(loaded, r, roof_gbps)
    settings = {
        "model": shown_path(model_dir), "architecture": loaded.config.architecture, "device": args.device,
        "cpu": _cpu_name(), "dtype": args.dtype, "expert_dtype": args.expert_dtype,
        "buffer_fraction": args.buffer_fraction, "link_gbps": args.link_gbps,
        "link_latency_us": args.link_latency_us, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "warmup": "1 run per mode",
        "cpu_threads": args.cpu_threads, "prompts": "fresh per round, the same for every mode",
        "prefill_len": args.prefill_len, "load_format": args.load_format,
        "link_gbps_measured": None if link_gbps is None else round(link_gbps, 2),
        "host_gbps_measured": None if host_gbps is None else round(host_gbps, 2),
        "all_core_read_gbps": None if roof_gbps is None else round(roof_gbps, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "summaries": summaries, "torch": torch.__version__,
    }  # fmt: skip
    data = {"settings": settings, "results": rows}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print(data)
    return 0


def _all_core_roof(rounds: int = 5) -> float:
    """GB/s that all the host's cores read at once (median of ``rounds``; ``bench cpu-experts``'
    read roof, 256 MiB a thread)."""
    from moeserve.bench.cpu_experts import ReadRoof

    roof = ReadRoof(os.cpu_count() or 1, 256)
    return statistics.median(roof.round() for _ in range(rounds))


def _floor_ms(loaded: Any, row: dict, roof_gbps: float) -> float:
    """The step floor on a CPU device (module docstring; TPOT is a step's time): the dense weights
    once and each expert lookup's bytes (a step looks each expert it uses up once) at ``roof_gbps``."""
    from moeserve.bench.decode_bounds import dense_read_bytes, expert_read_bytes

    step_bytes = dense_read_bytes(loaded.dense) + row["lookups_per_step"] * expert_read_bytes(loaded)
    return 1e3 * step_bytes / (roof_gbps * 1e9)


def _rates(link_arg: float, fits: dict, expert_nbytes: int) -> tuple[float | None, float | None]:
    """(link GB/s, host GB/s) for the hybrid bound: the emulated link's, or the I/O thread's timed
    copies; the CPU pool's kernel at one row as measured at load. None where no hybrid mode ran."""
    measured = [f for f in fits.values() if f is not None]
    if not measured:
        return (link_arg or None), None
    link = link_arg or expert_nbytes / (1e-3 * min(measured[0]["link_ms"])) / 1e9
    return link, measured[0]["host_gbps"]


def _fits(placer: Any) -> dict | None:
    if placer is None:
        return None
    c, d = placer.cpu_cost, placer.device_cost
    return {
        "host_gbps": placer.executor.choice.gbps(),
        "cpu_ms_per_expert": 1e3 * c.per_expert_s, "cpu_ms_per_row": 1e3 * c.per_row_s,
        "device_ms_per_expert": 1e3 * d.per_expert_s, "device_ms_per_row": 1e3 * d.per_row_s,
        "link_ms": [1e3 * placer.link_seconds(p) for p in placer.buffer.parts],
        "cpu_start_ms": 1e3 * placer.cpu_start_s,
        "device_shared_ms_per_expert": 1e3 * placer.device_cost_shared.per_expert_s,
    }  # fmt: skip


def _row(mode: str, runs: list[dict], fits: dict | None, batch: int) -> dict:
    tpots = [1e3 * r["tpot_s"] for r in runs]
    steps = sum(r["steps"] for r in runs)
    lookups = sum(r["lookups"] for r in runs)
    errors = [e for r in runs for e in r["errors"]]
    return {
        "mode": mode, "tpot_ms": statistics.median(tpots), "tpot_ms_min": min(tpots),
        "tpot_ms_max": max(tpots), "tpot_ms_runs": tpots,
        "hit_rate": sum(r["hits"] for r in runs) / lookups if lookups else 0.0,
        "misses_per_token": (lookups - sum(r["hits"] for r in runs)) / (steps * batch),
        "lookups_per_step": lookups / steps,
        "cpu_experts_per_step": sum(r["cpu_experts"] for r in runs) / steps,
        "moved_mib_per_token": sum(r["moved"] for r in runs) / (steps * batch) / (1 << 20),
        "prediction_error_median": statistics.median(errors) if errors else None,
        "prediction_layer_runs": len(errors), "fits": fits,
    }  # fmt: skip


def _print(data: dict) -> None:
    from richconsole import Table, make_console

    console = make_console()
    s = data["settings"]
    console.print("\n".join(f"{k}: {v}" for k, v in s.items() if k != "summaries"))
    for m, line in s["summaries"].items():
        console.print(f"{m}: {line}")
    table = Table(*HEADER)
    for row in _cells(data["results"], 1):
        table.add_row(*row)
    console.print(table)


def markdown(data: dict[str, Any]) -> str:
    """The modes as a Markdown table with the settings line (for a generated docs block)."""
    from moeserve.bench.render import md_table

    settings = ", ".join(f"`{k}={v}`" for k, v in data["settings"].items() if k != "summaries")
    return md_table(HEADER, _cells(data["results"], 2)) + f"\nSettings: {settings}\n"


HEADER = ["mode", "TPOT ms [min-max]", "vs first", "hybrid bound ms", "step floor ms", "prefill ms [min-max]",
          "hit rate", "CPU experts/step", "MiB moved/token", "cost model error (layer runs)"]  # fmt: skip


def _cells(results: list[dict], digits: int) -> list[list[str]]:
    """The table's cells per mode (:data:`HEADER`); ``digits`` after the point for milliseconds."""
    first = results[0]["tpot_ms"]

    def spread(r: dict, key: str) -> str:
        if r.get(key) is None:
            return ""
        return f"{r[key]:.{digits}f} [{r[key + '_min']:.{digits}f}-{r[key + '_max']:.{digits}f}]"

    out = []
    for r in results:
        err, bound, floor = r["prediction_error_median"], r.get("hybrid_bound_ms"), r.get("step_floor_ms")
        out.append([
            r["mode"], spread(r, "tpot_ms"), f"{r['tpot_ms'] / first:.2f}",
            "" if bound is None else f"{bound:.{digits}f}", "" if floor is None else f"{floor:.{digits}f}",
            spread(r, "prefill_ms"), f"{r['hit_rate']:.3f}",
            f"{r['cpu_experts_per_step']:.2f}", f"{r['moved_mib_per_token']:.2f}",
            "" if err is None else f"{100 * err:.1f}% ({r['prediction_layer_runs']})",
        ])  # fmt: skip
    return out
