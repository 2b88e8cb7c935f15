"""``moeserve bench render FILE``: a benchmark's ``--json`` output as Markdown tables for ``docs/``.

Knows the two runtime benchmarks: ``bench decode`` (TPOT per buffer size, link and batch, with its
spread, HBM and link bounds and the transformers ratio; the prefill rows) and ``bench policies``
(MoE-Infinity Tables 2/3/5 layout: hit rate against the oracle, blocking time and bytes per token
normalised to on-demand, prefetch precision = prefetches used / prefetches that landed in a slot,
TPOT, each as median [min-max] over repeats, and the eam vs on-demand+LRU verdicts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="print a bench --json file as Markdown tables")
    p.add_argument("file", type=Path, help="output of `moeserve bench decode|policies --json`")
    p.set_defaults(func=run)


def _settings(settings: dict) -> str:
    return "Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items())


def _ms(x: float | None) -> str:
    return f"{x:.2f}" if x else ""


def _spread(lo: float | None, hi: float | None) -> str:
    return f"{lo:.2f}-{hi:.2f}" if lo is not None and hi is not None else ""


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells as text), ending with a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def render_decode(data: dict) -> str:
    """Decode rows (TPOT, spread, process CPU time per step where recorded, HBM and link bounds,
    transformers), then prefill rows, then the settings line."""
    decode_header = ["buffer", "slots", "link GB/s", "batch", "TPOT ms", "spread ms", "CPU ms/step",
                     "HBM bound ms", "link bound ms", "hit rate", "blocking ms/token", "KiB/token",
                     "transformers TPOT ms", "ours / transformers"]  # fmt: skip
    rows = [
        [
            f"{r['buffer_fraction']:.0%}",
            str(r["buffer_slots"]),
            str(r["link_gbps"] or "off"),
            str(r["batch"]),
            f"{r['tpot_ms']:.2f}",
            _spread(r.get("tpot_ms_min"), r.get("tpot_ms_max")),
            _ms(r.get("cpu_ms")),
            f"{r['hbm_bound_ms']:.3f}" if "hbm_bound_ms" in r else "",
            f"{r['link_bound_ms']:.3f}" if "link_bound_ms" in r else "",
            f"{r['hit_rate']:.3f}",
            f"{r['blocking_ms_per_token']:.3f}",
            f"{r['bytes_per_token'] / 1024:.1f}",
            _ms(r.get("transformers_tpot_ms")),
            _ms(r.get("ratio_vs_transformers")),
        ]
        for r in data["results"]
    ]
    formats = {r.get("expert_dtype", "auto") for r in data["results"]}
    if formats != {"auto"}:  # several expert formats (bench decode --expert-dtypes): name each row's
        decode_header = ["experts", "KiB/expert", *decode_header]
        rows = [
            [r.get("expert_dtype", "auto"), f"{r.get('expert_bytes', 0) / 1024:.1f}", *row]
            for r, row in zip(data["results"], rows)
        ]
    out = md_table(decode_header, rows)
    if data.get("prefill"):
        prefill_header = ["buffer", "slots", "prompt tokens", "prefill ms", "spread ms",
                          "prompt tokens/s", "HBM bound ms", "link bound ms", "transformers prefill ms",
                          "ours / transformers"]  # fmt: skip
        rows = [
            [
                f"{r['buffer_fraction']:.0%}",
                str(r["buffer_slots"]),
                str(r["prompt_tokens"]),
                f"{r['prefill_ms']:.1f}",
                _spread(r["prefill_ms_min"], r["prefill_ms_max"]),
                f"{r['tokens_per_s']:.0f}",
                f"{r['hbm_bound_ms']:.3f}",
                f"{r['link_bound_ms']:.3f}",
                _ms(r.get("transformers_prefill_ms")),
                _ms(r.get("ratio_vs_transformers")),
            ]
            for r in data["prefill"]
        ]
        prefill = md_table(prefill_header, rows)
        out += "\nPrefill (one prompt, batch 1, admission to first token):\n\n" + prefill
    return out + "\n" + _settings(data["settings"]) + "\n"


def fmt_spread(
    median: float | None, lo: float | None, hi: float | None, fmt: str = "{:.2f}", scale: float = 1.0
) -> str:
    """``median [lo, hi]``, each times ``scale``; the median alone when there is no spread (a
    single-run file); "" for None."""
    if median is None:
        return ""
    if lo is None or hi is None:
        return fmt.format(median * scale)
    return f"{fmt.format(median * scale)} [{fmt.format(lo * scale)}, {fmt.format(hi * scale)}]"


def fmt_key(d: dict, key: str, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """``d[key]`` with the spread ``d[key_min]``-``d[key_max]`` beside it (see :func:`fmt_spread`)."""
    return fmt_spread(d.get(key), d.get(key + "_min"), d.get(key + "_max"), fmt, scale)


def verdict_rows(verdicts: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the eam vs on-demand+LRU table of a policies run (one row per buffer):
    TPOT and blocking with their spreads and verdicts, the TPOT-ratio and gap-closed targets."""
    header = ["buffer", "eam TPOT ms", "on-demand+lru TPOT ms", "TPOT", "eam blocking ms/token",
              "on-demand blocking ms/token", "blocking", "TPOT eam / on-demand",
              "<= 1.02", "gap closed", ">= 0.5"]  # fmt: skip
    rows = []
    for v in verdicts:
        rows.append(
            [
                f"{v['buffer_fraction']:.0%}",
                fmt_key(v, "tpot_ms"),
                fmt_key(v, "on_demand_tpot_ms"),
                f"eam {v['tpot']}" if v["tpot"] != "within noise" else v["tpot"],
                fmt_key(v, "blocking_ms_per_token"),
                fmt_key(v, "on_demand_blocking_ms_per_token"),
                f"eam {v['blocking']}" if v["blocking"] != "within noise" else v["blocking"],
                fmt_key(v, "tpot_ratio", "{:.3f}"),
                v["tpot_ratio_verdict"],
                fmt_key(v, "gap_closed"),
                v["gap_closed_verdict"],
            ]
        )
    return header, rows


def render_policies(data: dict) -> str:
    """Per buffer size, one table of median [min, max] over repeats (the median alone for a
    single-run file), then the eam vs on-demand verdicts (when present), then the settings line."""
    out = []
    rows = data["results"]
    for fraction in sorted({r["buffer_fraction"] for r in rows}):
        group = [r for r in rows if r["buffer_fraction"] == fraction]
        base = next((r for r in group if r["policy"] == "on-demand+lru"), None)
        oracle = next((r for r in group if r["policy"] == "oracle"), None)
        lru = base
        out.append(f"**Buffer {fraction:.0%} of experts ({group[0]['buffer_slots']} slots)**\n")
        out.append(
            "| policy | hit rate | vs oracle (points) | vs lru (x) | blocking ms/token "
            "| blocking vs on-demand | KiB/token | bytes vs on-demand | prefetch precision | TPOT ms "
            "| CPU ms/step | expert batches/step | TPOT vs on-demand | gap closed | bytes vs oracle |"
        )
        out.append("|" + "---|" * 15)
        for r in group:
            vs_oracle = f"{100 * (r['hit_rate'] - oracle['hit_rate']):+.1f}" if oracle else ""
            vs_lru = f"{r['hit_rate'] / lru['hit_rate']:.2f}" if lru and lru["hit_rate"] else ""
            blk = (
                f"{r['blocking_ms_per_token'] / base['blocking_ms_per_token']:.2f}"
                if base and base["blocking_ms_per_token"]
                else ""
            )
            byt = (
                f"{r['bytes_per_token'] / base['bytes_per_token']:.2f}"
                if base and base["bytes_per_token"]
                else ""
            )
            landed = r.get("prefetch_landed", r["prefetch_issued"])
            prec = f"{r['prefetch_used'] / landed:.2f}" if landed else ""
            bvo = f"{r['bytes_vs_oracle']:.2f}" if r.get("bytes_vs_oracle") is not None else ""
            kib = fmt_key(r, "bytes_per_token", "{:.0f}", 1 / 1024)
            out.append(
                f"| {r['policy']} | {fmt_key(r, 'hit_rate', '{:.3f}')} | {vs_oracle} | {vs_lru} | "
                f"{fmt_key(r, 'blocking_ms_per_token')} | {blk} | {kib} | {byt} | "
                f"{prec} | {fmt_key(r, 'tpot_ms')} | {fmt_key(r, 'cpu_ms')} | "
                f"{fmt_key(r, 'expert_batches_per_step', '{:.1f}')} | "
                f"{fmt_key(r, 'tpot_vs_on_demand', '{:.3f}')} | "
                f"{fmt_key(r, 'gap_closed')} | {bvo} |"
            )
        out.append("")
    if data.get("verdicts"):
        header, vrows = verdict_rows(data["verdicts"])
        out.append("**`eam` against `on-demand+lru`** (a verdict only where the spreads do not overlap)\n")
        out.append(md_table(header, vrows))
    return "\n".join(out) + "\n" + _settings(data["settings"]) + "\n"


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError

    try:
        data = json.loads(args.file.read_text())
        kind = "policies" if "policy" in data["results"][0] else "decode"
    except (OSError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(
            f"{args.file}: not a `moeserve bench decode|policies --json` output ({exc})"
        ) from None
    print(render_policies(data) if kind == "policies" else render_decode(data))
    return 0


def render_quant_decode(data: dict) -> str:
    """``bench decode --expert-dtypes ...``: a line with each format's bytes per token against bf16's
    (min-max over the rows of equal buffer, link and batch), then :func:`render_decode`."""
    rows = data["results"]
    key = ("buffer_fraction", "link_gbps", "batch")
    bf16 = {tuple(r[k] for k in key): r["bytes_per_token"] for r in rows if r.get("expert_dtype") == "bf16"}
    parts = []
    for fmt in dict.fromkeys(r.get("expert_dtype") for r in rows if r.get("expert_dtype") != "bf16"):
        ratios = [
            bf16[tuple(r[k] for k in key)] / r["bytes_per_token"]
            for r in rows
            if r.get("expert_dtype") == fmt and r["bytes_per_token"] and tuple(r[k] for k in key) in bf16
        ]
        if ratios:
            lo, hi = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
            parts.append(f"{fmt} moves {lo if lo == hi else f'{lo}-{hi}'}x fewer bytes per token than bf16")
    head = "; ".join(parts) + " (same buffer, link and batch).\n\n" if parts else ""
    return head + render_decode(data)


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "" if x is None else fmt.format(x)


def _settings_of(settings: dict, keys: tuple[str, ...]) -> str:
    return "Settings: " + ", ".join(f"`{k}={settings[k]}`" for k in keys if k in settings)


CLIENT_SETTINGS = ("model", "rps", "trace_offset_s", "duration_s", "max_tokens_cap", "max_context", "seed")


def render_replay(summary: dict) -> str:
    """A ``moeserve replay`` run (its ``summary.json``): latency percentiles, then the run's rates and
    the server's expert counters over it."""
    rows = [
        [name, str(summary[key]["count"])]
        + [_f(summary[key][q]) for q in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")]
        for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("e2e", "e2e"))
    ]
    out = md_table(["latency", "n", "mean ms", "p50 ms", "p90 ms", "p99 ms"], rows)
    server = summary.get("server") or {}
    moved = server.get("transfer_bytes") or {}
    slo = summary.get("slo_tpot_ms")
    run = [
        f"{summary['succeeded']} / {summary['failed']}",
        _f(summary.get("offered_rps"), "{:.3f}"),
        _f(summary["throughput_rps"], "{:.3f}"),
        _f(summary["output_tokens_per_s"]),
        _f(summary.get("goodput_rps"), "{:.3f}"),
        _f(server.get("hit_rate"), "{:.3f}"),
        _f(server.get("blocking_s"), "{:.2f}"),
        " / ".join(f"{moved.get(k, 0) / 1e6:.0f}" for k in ("demand", "prefetch")),
    ]
    header = ["requests ok / failed", "offered req/s", "done req/s", "output tokens/s",
              f"goodput req/s (TPOT <= {slo:g} ms)" if slo else "goodput req/s", "buffer hit rate",
              "blocking s", "MB moved (demand / prefetch)"]  # fmt: skip
    out += "\n" + md_table(header, [run])
    return out + "\n" + _settings_of(summary["settings"], CLIENT_SETTINGS) + "\n"


def render_sweep(data: dict) -> str:
    """``moeserve bench sweep --json``: one row per rate (the server's counters per rate's run)."""
    header = ["--rps", "offered req/s", "done req/s", "goodput req/s", "output tokens/s", "TTFT p50 / p90 ms",
              "TPOT p50 / p90 ms", "e2e p50 ms", "hit rate", "blocking s", "failed"]  # fmt: skip
    rows = [
        [
            f"{r['rps']:g}",
            _f(r["offered_rps"], "{:.3f}"),
            _f(r["throughput_rps"], "{:.3f}"),
            _f(r["goodput_rps"], "{:.3f}"),
            _f(r["output_tokens_per_s"]),
            f"{_f(r['ttft_p50_ms'], '{:.0f}')} / {_f(r['ttft_p90_ms'], '{:.0f}')}",
            f"{_f(r['tpot_p50_ms'])} / {_f(r['tpot_p90_ms'])}",
            _f(r["e2e_p50_ms"], "{:.0f}"),
            _f(r["hit_rate"], "{:.3f}"),
            _f(r["blocking_s"]),
            f"{r['failed']} / {r['requests']}",
        ]
        for r in data["rows"]
    ]
    return md_table(header, rows) + "\n" + _settings_of(data["settings"], CLIENT_SETTINGS) + "\n"


def render_overhead(data: dict) -> str:
    """``moeserve bench overhead --sections --json``: host time per routed MoE layer, p50 (p90) in
    us, median over repeats, with the gate as it decides and forced open, and the budget verdict."""
    header = ["batch", "all layers", "layers that plan", "a planning layer", "gate open",
              "gate open: predict / lookahead / gate / queue", "EAMC term in", "budget"]  # fmt: skip
    rows = []
    for r in data["results"]:
        parts = " / ".join(
            _f(r.get(f"open_section_{n}_p50_us")) for n in ("predict", "lookahead", "gate", "queue")
        )
        rows.append(
            [
                str(r["batch"]),
                f"{r['total_p50_us']:.1f} ({r['total_p90_us']:.1f})",
                f"{r['planned_share']:.0%}",
                f"{r['planned_total_p50_us']:.1f} ({r['planned_total_p90_us']:.1f})",
                f"{r['open_total_p50_us']:.1f} ({r['open_total_p90_us']:.1f})",
                parts,
                f"{r['eamc_term_share']:.0%} of plans",
                f"{r['budget_us']:.0f} us: {'met' if r['meets_budget'] else 'not met'}",
            ]
        )
    keys = ("model_profile", "hardware", "policies", "router_lookahead", "eamc_term", "buffer", "tokens",
            "warm_requests", "repeats", "seed")  # fmt: skip
    return md_table(header, rows) + "\n" + _settings_of(data["settings"], keys) + "\n"


def render_eamc(data: dict | list[dict]) -> str:
    """``moeserve bench eamc --json`` runs: search and incremental matching time per query, us."""
    header = ["L x E", "entries", "index", "search, batch 1", "search, batch 16 (per query)",
              "PrefixMatcher per layer, batch 1", "PrefixMatcher per layer, batch 16 (per query)",
              "paper, per query"]  # fmt: skip
    rows = []
    for r in data if isinstance(data, list) else [data]:
        s = r["settings"]
        p1, p16 = r.get("prefix_batch1"), r.get("prefix_batch16")
        rows.append(
            [
                f"{s['layers']} x {s['experts']}",
                f"{s['entries']:,}",
                s["index"],
                _f(r["batch1"]["median_us"]),
                _f(r["batch16"]["per_query_us"]),
                _f(p1["per_layer_us"]) if p1 else "",
                _f(p16["per_layer_us"] / 16) if p16 else "",
                _f(r.get("paper_us_per_query"), "{:g}"),
            ]
        )
    return md_table(header, rows)
