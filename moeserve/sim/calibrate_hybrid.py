"""Calibration of hybrid expert execution: the simulator's ``cpu`` and ``auto`` rows against the
runtime's own (``--expert-compute cpu`` and ``auto``) at :mod:`moeserve.sim.calibrate`'s settings.

NOTE: what is compared. The runtime runs ``bench policies``'s warm-then-eval sequence (its
``_Runs``, one fresh engine per row) with ``--expert-compute cpu`` (no prefetch, LRU over a fixed
set: llama.cpp's ``--n-cpu-moe``) and ``auto`` for each of ``--auto-policies``, under the
:class:`~moeserve.sim.probe.RuntimeProbe`, which also times the compute thread's waits for CPU
experts and every CPU expert. The simulator replays the recorded trace with the same mode, one
CPU lane (the runtime's pool of ``default_threads`` for ``--cpu-threads``, every thread on each
expert) and :func:`~moe_runtime.hybrid.cost_model.place_layer`, from two cost sets as for the
fetch-only rows: ``offline`` (the resident engine's costs and the CPU kernels' load-time
measurement, ``choose_kernels`` on that pool as the runtime measures them at load) and ``in-run``
(the run's own records: the device's expert phases and the gaps between layers less the CPU
waits, and the CPU experts fitted as ``a + b * rows``). Target: TPOT within 25% (blocking alone
misses the CPU's share); the hit rate is shown beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moeserve.bench import policies as bench
from moeserve.sim.probe import Costs, RuntimeProbe, costs_from_records

#: the fetch-only rows also run under ``auto`` by default
AUTO_POLICIES = "on-demand+lru,eam-paper"


def hybrid_rows(auto_policies: str) -> list[tuple[str, str, str, dict]]:
    """The runtime rows: ``cpu``, then ``LABEL (auto)`` per bench row named in ``auto_policies``."""
    rows = [("cpu", "on-demand", "lru", {"expert_compute": "cpu"})]
    for label in (p for p in auto_policies.split(",") if p):
        _, prefetch, cache, over = next(c for c in bench.COMBOS if c[0] == label)
        rows.append((f"{label} (auto)", prefetch, cache, {**over, "expert_compute": "auto"}))
    return rows


def threads(args: argparse.Namespace) -> int:
    """The runtime's CPU expert threads at these settings (one device: one I/O thread)."""
    from moe_runtime.hybrid.setup import default_threads

    return default_threads(args.cpu_threads, 1)


def offline_cpu_cost(loaded: Any, threads: int, cpu_threads: int) -> Any:
    """The CPU kernels' load-time fit, measured as the runtime measures it (``setup.attach``: the
    whole pool of ``threads`` on each expert, helped by the caller at one compute thread)."""
    from moe_runtime.hybrid.setup import measure_pool
    from moeserve.sim.hybrid import CPUCost

    executor, fit = measure_pool(loaded.store, threads, helps=cpu_threads == 1)
    executor.close()
    return CPUCost.measured(fit.per_expert_s, fit.per_row_s, "choose_kernels at load")


def run_runtime(
    loaded: Any, args: argparse.Namespace, warm: list, evals: list, rows: list[tuple]
) -> list[tuple[float, tuple, dict[str, Any], Any]]:
    """Each hybrid row at each buffer fraction on the runtime: ``(fraction, row, its bench
    result as a dict, its probe records)``."""
    from moe_runtime.config import RuntimeConfig

    base = RuntimeConfig(
        dtype=args.dtype, max_batch_size=args.batch, cpu_threads=args.cpu_threads,
        link_gbps=args.link_gbps or None, link_latency_us=args.link_latency_us,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8, expert_compute="device",
    )  # fmt: skip
    runs = bench._Runs(loaded, base, warm, evals, args)
    out = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        for row in rows:
            with RuntimeProbe() as probe:
                res, _ = runs.run_one(fraction, row, None)
            out.append((fraction, row, asdict(res), probe.runs[0]))
    return out


def base_row(r: dict[str, Any], s: dict[str, float], mode: str, rep: int) -> dict[str, Any]:
    """The fields every calibration row starts with: which run (``r`` the runtime's row, ``s`` the
    simulator's figures, ``mode`` the cost set, ``rep`` the repeat) and both hit rates."""
    return {
        "repeat": rep,
        "buffer_fraction": r["buffer_fraction"],
        "policy": r["policy"],
        "costs": mode,
        "hit_runtime": round(r["hit_rate"], 4),
        "hit_sim": round(s["hit_rate"], 4),
    }


def _row(r: dict[str, Any], s: dict[str, float], mode: str, rep: int) -> dict[str, Any]:
    err = s["tpot_ms"] / r["tpot_ms"] - 1 if r["tpot_ms"] else None
    return {
        **base_row(r, s, mode, rep),
        "tpot_ms_runtime": round(r["tpot_ms"], 3),
        "tpot_ms_sim": round(s["tpot_ms"], 3),
        "tpot_rel_err": None if err is None else round(err, 3),
        "tpot_ok": err is not None and abs(err) <= 0.25,
        "cpu_experts_per_token_sim": round(s["cpu_per_token"], 3),
    }


def compare(
    results: list[tuple[float, tuple, dict[str, Any], Any]],
    offline: Costs,
    offline_cpu: Any,
    link: dict[str, float],
    traces: tuple[Path, Path],
    args: argparse.Namespace,
    loaded: Any,
    rep: int,
    simulate: Callable[..., dict[str, float]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The simulator's figures for each runtime row with both cost sets (``simulate``: the
    calibration's one-combination run, :func:`moeserve.sim.calibrate.simulate`); returns the
    comparison rows and the in-run costs."""
    from moeserve.sim.hybrid import CPUCost, HybridConfig

    cfg, nbytes, n_threads = loaded.config, loaded.store.expert_nbytes, threads(args)
    rows, costs = [], []
    for fraction, (label, prefetch, cache, over), r, rec in results:
        mode = over["expert_compute"]
        combo = ("cpu" if mode == "cpu" else label.removesuffix(" (auto)"), prefetch, cache)
        inrun = costs_from_records(rec, cfg.num_moe_layers, cfg.top_k)
        gap = link["io_gap_s"] if inrun.io_gap_s is None else inrun.io_gap_s
        inrun.transfer_s = (inrun.transfer_s or link["hold_s"]) + gap
        cpu_in = offline_cpu
        if inrun.cpu_a_s is not None:
            cpu_in = CPUCost.measured(inrun.cpu_a_s, inrun.cpu_b_s or 0.0, "the run's CPU jobs")
        costs.append({"repeat": rep, "buffer_fraction": fraction, "policy": label, **asdict(inrun)})
        wake = link["wake_s"]
        for name, c, cpu, scale in (("offline", offline, offline_cpu, 1.0), ("in-run", inrun, cpu_in, 0.0)):
            hybrid = HybridConfig(mode, n_threads, cpu)
            s = simulate(c, traces, fraction, combo, args.batch, nbytes, scale, wake, hybrid)
            rows.append(_row(r, s, name, rep))
    return rows, costs


def summary(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Per cost set: how many hybrid rows meet the TPOT target."""
    out = {}
    for mode in ("offline", "in-run"):
        sel = [r for r in rows if r["costs"] == mode]
        out[mode] = f"hybrid TPOT within 25%: {sum(r['tpot_ok'] for r in sel)}/{len(sel)}"
    return out


def print_rows(console: Any, rows: list[dict[str, Any]]) -> None:
    from richconsole import Table

    table = Table(title="hybrid execution: simulator vs runtime (TPOT)")
    for col in ("rep", "buffer", "row", "costs", "hit runtime", "hit sim", "TPOT runtime", "TPOT sim",
                "TPOT err", "CPU experts/token sim", "within 25%"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        err = "-" if r["tpot_rel_err"] is None else f"{100 * r['tpot_rel_err']:+.0f}%"
        table.add_row(
            str(r["repeat"]), f"{r['buffer_fraction']:.0%}", r["policy"], r["costs"],
            f"{r['hit_runtime']:.3f}", f"{r['hit_sim']:.3f}", f"{r['tpot_ms_runtime']:.2f}",
            f"{r['tpot_ms_sim']:.2f}", err, f"{r['cpu_experts_per_token_sim']:.2f}",
            "yes" if r["tpot_ok"] else "no",
        )  # fmt: skip
    console.print(table)
    for mode, text in summary(rows).items():
        console.print(f"{mode} costs: {text}")
