"""Paper-style result tables of the simulator (MoE-Infinity §7.2-7.3, Tables 2, 3 and 5).

Table 2 normalises GPU blocking time to on-demand fetching, Table 3 bandwidth (bytes moved) to
on-demand, Table 5 reports the buffer hit rate with the oracle as "Ideal". The simulator prints
all three views in one table per buffer size, with absolute figures beside the ratios, and the
settings (model and hardware profiles, cost model, slots, batch, trace) underneath.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moeserve.sim.engine import PolicyRun

MiB = 1 << 20


@dataclass(slots=True)
class Row:
    """One policy's figures (per generated token unless named otherwise)."""

    policy: str
    prefetch: str
    cache: str
    slots: int
    lookups: int
    hits: int
    hit_rate: float
    blocking_ms_per_token: float
    bytes_per_token: float
    tpot_ms: float
    tokens: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_cancelled: int
    late_prefetches: int
    demand_fetches: int
    sim_lookups: int
    wall_s: float
    gap_closed: float | None = None  # share of the on-demand+LRU -> oracle TPOT gap closed
    bytes_vs_oracle: float | None = None  # bytes moved per token / the oracle's
    expert_compute: str = "device"  # where misses ran (--expert-compute)
    cpu_threads: int = 0  # the CPU pool's threads, all on each CPU expert (0: no CPU side)
    bound_ms: float | None = None  # the hybrid bound of a step, aggregated as TPOT (moeserve.sim.hybrid)
    placement: dict[str, float] | None = None  # per decode step: experts on the CPU, copied, resident
    prefill_placement: dict[str, float] | None = None  # the same per prefill step (and their count)


def gap_closed(tpot: float, on_demand: float, oracle: float) -> float | None:
    """Fraction of the TPOT gap from on-demand+LRU (0) to the oracle (1) that ``tpot`` closes;
    negative when slower than on-demand, None when there is no gap (oracle not faster)."""
    gap = on_demand - oracle
    return (on_demand - tpot) / gap if gap > 0 else None


def add_relative(rows: list[Any], group: str = "slots") -> list[Any]:
    """Fill ``gap_closed`` and ``bytes_vs_oracle`` of each row (a :class:`Row` or a bench
    ``PolicyResult``: ``policy``, ``tpot_ms``, ``bytes_per_token``) against the ``on-demand+lru``
    and ``oracle`` rows with the same ``group`` attribute (buffer size); left None where either is
    missing. Returns ``rows``."""
    for size in {getattr(r, group) for r in rows}:
        block = [r for r in rows if getattr(r, group) == size]
        base = next((r for r in block if r.policy == "on-demand+lru"), None)
        oracle = next((r for r in block if r.policy == "oracle"), None)
        if base is None or oracle is None:
            continue
        for r in block:
            r.gap_closed = gap_closed(r.tpot_ms, base.tpot_ms, oracle.tpot_ms)
            r.bytes_vs_oracle = r.bytes_per_token / oracle.bytes_per_token if oracle.bytes_per_token else None
    return rows


def row_of(run: PolicyRun) -> Row:
    st = run.stats
    hy = run.hybrid or {}
    bound = hy.get("bound_s")
    return Row(
        policy=run.label,
        prefetch=run.prefetch,
        cache=run.cache,
        slots=run.slots,
        lookups=run.lookups,
        hits=int(st["hits"]),
        hit_rate=run.hit_rate,
        blocking_ms_per_token=1e3 * run.blocking_s_per_token,
        bytes_per_token=run.bytes_per_token,
        tpot_ms=1e3 * run.tpot_s,
        tokens=run.tokens,
        prefetch_issued=int(st["prefetch_issued"]),
        prefetch_used=int(st["prefetch_used"]),
        prefetch_cancelled=int(st["prefetch_cancelled"]),
        late_prefetches=int(st["late_prefetches"]),
        demand_fetches=int(st["demand_fetches"]),
        sim_lookups=run.sim_lookups,
        wall_s=run.wall_s,
        expert_compute=hy.get("mode", "device"),
        cpu_threads=hy.get("threads", 0),
        bound_ms=None if bound is None else 1e3 * bound,
        placement=_counts(hy.get("decode")),
        prefill_placement=_counts(hy.get("prefill"), steps=True),
    )


def _counts(c: dict[str, Any] | None, steps: bool = False) -> dict[str, float] | None:
    """A step kind's mean experts per step (and its step count), None when it had no step."""
    if not c or not c["steps"]:
        return None
    out = {k: round(c[k], 2) for k in ("cpu", "copied", "resident")}
    return {**out, "steps": c["steps"]} if steps else out


def placement_text(c: dict[str, float] | None) -> str:
    """``cpu / copied / resident`` experts per step, or ``-``."""
    return "-" if c is None else f"{c['cpu']:.1f} / {c['copied']:.1f} / {c['resident']:.1f}"


def as_json(settings: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    return {"settings": settings, "results": [asdict(r) for r in rows]}


def _ratio(x: float, base: float | None) -> str:
    return f"{100 * x / base:.0f}%" if base else "-"


def _share(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x is not None else "-"


def print_tables(settings: dict[str, Any], rows: list[Row], title: str = "moeserve simulate") -> None:
    """The paper-style table (one block per buffer size) and the settings line."""
    from richconsole import Table, make_console

    console = make_console()
    table = Table(title=title)
    cols = (
        "slots",
        "policy",
        "hit rate (T5)",
        "vs oracle",
        "block ms/tok",
        "block vs on-demand (T2)",
        "MiB/tok",
        "bytes vs on-demand (T3)",
        "TPOT ms",
        "gap closed",
        "bytes vs oracle",
        "prefetch used/issued",
    )
    hybrid = any(r.bound_ms is not None for r in rows)
    if hybrid:
        cols += ("hybrid bound ms", "CPU / copied / resident per step", "prefill steps: the same")
    for col in cols:
        table.add_column(col, justify="right")
    for slots in sorted({r.slots for r in rows}):
        block = [r for r in rows if r.slots == slots]
        fetch = [r for r in block if r.expert_compute == "device"]
        base = next((r for r in fetch if (r.prefetch, r.cache) == ("on-demand", "lru")), None)
        base = base or next((r for r in fetch if r.prefetch == "on-demand"), None)
        oracle = next((r for r in block if r.prefetch == "oracle"), None)
        for r in block:
            table.add_row(
                str(slots),
                r.policy,
                f"{r.hit_rate:.3f}",
                f"{r.hit_rate - oracle.hit_rate:+.3f}" if oracle else "-",
                f"{r.blocking_ms_per_token:.2f}",
                _ratio(r.blocking_ms_per_token, base.blocking_ms_per_token if base else None),
                f"{r.bytes_per_token / MiB:.1f}",
                _ratio(r.bytes_per_token, base.bytes_per_token if base else None),
                f"{r.tpot_ms:.2f}",
                _share(r.gap_closed),
                f"{r.bytes_vs_oracle:.2f}x" if r.bytes_vs_oracle is not None else "-",
                f"{r.prefetch_used}/{r.prefetch_issued}",
                *(
                    (
                        "-" if r.bound_ms is None else f"{r.bound_ms:.2f}",
                        placement_text(r.placement),
                        placement_text(r.prefill_placement),
                    )
                    if hybrid
                    else ()
                ),
            )
    console.print(table)
    console.print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), soft_wrap=True)


def print_single(settings: dict[str, Any], row: Row) -> None:
    """One policy: the four headline figures, then the settings line."""
    print(
        f"{row.policy}: hit rate {row.hit_rate:.3f} ({row.hits}/{row.lookups} lookups), "
        f"blocking {row.blocking_ms_per_token:.2f} ms/token, {row.bytes_per_token / MiB:.1f} MiB/token, "
        f"predicted TPOT {row.tpot_ms:.2f} ms ({row.tokens} tokens)"
        + ("" if row.bound_ms is None else f", hybrid bound {row.bound_ms:.2f} ms")
        + (
            ""
            if row.placement is None
            else f"; per step CPU / copied / resident {placement_text(row.placement)}"
            + (
                ""
                if row.prefill_placement is None
                else f" (prefill steps {placement_text(row.prefill_placement)})"
            )
        )
    )
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))


def print_profiles(kv_tokens: int) -> None:
    """Model profiles (sizes computed from their config shapes) with the buffer slots each GPU
    holds, then the hardware pieces with their effective figures and sources."""
    from moe_runtime.errors import ConfigError
    from moeserve.sim.hardware import (
        GPU_HOSTS,
        GPUS,
        HOST_MEMORY_EFFICIENCY,
        HOSTS,
        LINK_EFFICIENCY,
        LINKS,
        GiB,
        get_hardware,
    )
    from moeserve.sim.models import MODELS
    from richconsole import Table, make_console

    console = make_console()
    models = Table(title=f"model profiles (slots: GPU memory - dense - KV for {kv_tokens} tokens - 1 GiB)")
    for col in ("profile", "L", "E", "k", "expert MiB", "experts GiB", "dense params", "total params",
                "dense GiB", *(f"slots {g}" for g in GPUS)):  # fmt: skip
        models.add_column(col, justify="right")
    for m in MODELS.values():
        total = (m.dense_params + m.total_experts * m.expert_params) / 1e9
        slots = []
        for g in GPUS:
            try:
                slots.append(str(m.buffer_slots(get_hardware(f"{g}+pcie4"), kv_tokens)))
            except ConfigError:
                slots.append("0")
        models.add_row(
            m.name, str(m.num_layers), str(m.num_experts), str(m.top_k), f"{m.expert_bytes / MiB:.1f}",
            f"{m.total_experts * m.expert_bytes / GiB:.1f}", f"{m.dense_params / 1e9:.2f}B",
            f"{total:.1f}B", f"{m.dense_bytes / GiB:.2f}", *slots,
        )  # fmt: skip
    console.print(models)
    hw = Table(title=f"hardware (links at {LINK_EFFICIENCY:.0%} of the raw rate)")
    for col in ("name", "memory GiB", "peak TFLOP/s", "HBM GB/s", "raw GB/s", "effective GB/s", "us/copy",
                "source"):  # fmt: skip
        hw.add_column(col, justify="right")
    for g in GPUS.values():
        hw.add_row(g.name, f"{g.memory_bytes / GiB:.0f}", f"{g.peak_flops / 1e12:.1f}", f"{g.hbm_gbps:.0f}",
                   "", "", "", g.source)  # fmt: skip
    for lk in LINKS.values():
        hw.add_row(lk.name, "", "", "", f"{lk.raw_gbps:.1f}", f"{lk.gbps:.1f}", f"{lk.latency_us:.0f}",
                   lk.source)  # fmt: skip
    console.print(hw)
    hosts = Table(title=f"hosts (memory sustained at {HOST_MEMORY_EFFICIENCY:.0%} of the nominal rate)")
    for col in ("name", "beside", "cores", "CPU threads", "DRAM GB/s nominal", "sustained", "peak TFLOP/s",
                "sustained TFLOP/s", "us per CPU expert", "us per range", "source"):  # fmt: skip
        hosts.add_column(col, justify="right")
    for h in HOSTS.values():
        gpus = ", ".join(g for g, name in GPU_HOSTS.items() if name == h.name)
        hosts.add_row(h.name, gpus, str(h.cores), str(h.default_threads()), f"{h.mem_gbps_nominal:.1f}",
                      f"{h.mem_gbps:.1f}", f"{h.peak_flops / 1e12:.1f}", f"{h.sustained_flops / 1e12:.2f}",
                      f"{h.expert_overhead_us:.0f}", f"{h.unit_overhead_us:.0f}", h.source)  # fmt: skip
    console.print(hosts)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _policy_cells(r: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """A ``--json`` row's figures: hit rate, blocking and bytes (absolute and against on-demand+LRU,
    MoE-Infinity Tables 5, 2 and 3), TPOT, the on-demand -> oracle gap closed, prefetches."""
    return [
        f"{r['hit_rate']:.3f}",
        f"{r['blocking_ms_per_token']:.1f}",
        _ratio(r["blocking_ms_per_token"], base["blocking_ms_per_token"] if base else None),
        f"{r['bytes_per_token'] / MiB:,.0f}",
        _ratio(r["bytes_per_token"], base["bytes_per_token"] if base else None),
        f"{r['tpot_ms']:.1f}",
        _share(r.get("gap_closed")),
        f"{r['prefetch_used']}/{r['prefetch_issued']}",
    ]


POLICY_HEADER = ["hit rate (T5)", "blocking ms/token", "vs on-demand (T2)", "MiB/token",
                 "vs on-demand (T3)", "TPOT ms", "gap closed", "prefetches used/issued"]  # fmt: skip


def _base(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["policy"] == "on-demand+lru"), None)


def render_simulate(data: dict[str, Any] | list[dict[str, Any]]) -> str:
    """Markdown of one or more ``moeserve simulate --json`` outputs: per run, a line naming the
    model, hardware and slots, then one row per policy (figures per generated token)."""
    out = []
    for run in data if isinstance(data, list) else [data]:
        s = run["settings"]
        hardware = s["hardware"].split(":")[0]
        out.append(
            f"**{s['model_profile']} on {hardware}**, {s['slots']} slots ({s['slots_share']} of the "
            "experts), "
            f"batch {s['batch']}, {s['eval_requests']} measured requests after {s['warm_requests']} warm "
            f"ones; a copy takes {s['transfer_us'] / 1e3:.1f} ms, one expert for one token "
            f"{s['expert_us_1tok'] / 1e3:.2f} ms.\n"
        )
        base = _base(run["results"])
        rows = [[f"`{r['policy']}`", *_policy_cells(r, base)] for r in run["results"]]
        out.append(_md_table(["policy", *POLICY_HEADER], rows))
    return "\n".join(out)


def render_simulate_hybrid(data: list[dict[str, Any]]) -> str:
    """Markdown of several ``moeserve simulate --expert-compute device,cpu,auto --json`` outputs
    (rows ``eam``, ``oracle``, ``cpu``, ``eam (auto)``): one table row per output, TPOT of each
    mode, ``auto`` against fetch-only ``eam`` and against the better of ``device`` (``eam``) and
    ``cpu``, the hybrid bound and ``auto``'s placement per decode step and per prefill step (CPU /
    copied / resident experts)."""
    order = {h: i for i, h in enumerate(dict.fromkeys(d["settings"]["hardware"] for d in data))}
    data = sorted(data, key=lambda d: (order[d["settings"]["hardware"]], d["settings"]["batch"],
                                       -d["settings"]["cpu_threads"]))  # fmt: skip
    rows = []
    for run in data:
        s = run["settings"]
        r = {x["policy"]: x for x in run["results"]}
        eam, oracle, cpu, auto = r["eam"], r["oracle"], r["cpu"], r["eam (auto)"]
        bounds = f"{eam['bound_ms']:.1f} / {auto['bound_ms']:.1f}"
        rows.append(
            [
                f"{s['hardware'].split(':')[0]}, {s['slots']} slots",
                str(s["batch"]),
                str(s["cpu_threads"]),
                *(f"{x['tpot_ms']:.1f}" for x in (eam, oracle, cpu, auto)),
                f"{auto['tpot_ms'] / eam['tpot_ms']:.2f}",
                f"{auto['tpot_ms'] / min(eam['tpot_ms'], cpu['tpot_ms']):.2f}",
                bounds,
                placement_text(auto["placement"]),
                placement_text(auto["prefill_placement"]),
            ]
        )
    header = ["profile", "batch", "CPU threads", "`eam` (device) ms", "`oracle` ms", "`cpu` ms", "`auto` ms",
              "auto / eam", "auto / best of device, cpu", "bound ms (eam / auto)",
              "auto per step: CPU / copied / resident", "per prefill step (512-token prompts)"]  # fmt: skip
    per_hw: dict[str, str] = {}
    for d in data:
        st = d["settings"]
        hw = st["hardware"].split(":")[0]
        one, many = st["cpu_expert_us_1tok"] / 1e3, st["cpu_expert_us_128tok"] / 1e3
        per_hw.setdefault(
            hw,
            f"{hw}: a copy {st['transfer_us'] / 1e3:.1f} ms, a CPU expert {one:.2f} ms for one token and "
            f"{many:.1f} ms for 128 ({st['cpu_threads']} threads)",
        )
    head = f"**{data[0]['settings']['model_profile']}**, one expert: {'; '.join(per_hw.values())}.\n\n"
    return head + _md_table(header, rows)
