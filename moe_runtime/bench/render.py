"""``moeserve bench render FILE``: a benchmark's ``--json`` output as Markdown tables for ``docs/``.

Knows the two runtime benchmarks: ``bench decode`` (TPOT per buffer size, link and batch, with its
spread, HBM and link bounds and the transformers ratio; the prefill rows) and ``bench policies``
(MoE-Infinity Tables 2/3/5 layout: hit rate against the oracle, blocking time and bytes per token
normalised to on-demand, prefetch precision = prefetches used / prefetches that landed in a slot,
TPOT).
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


def _table(header: list[str], rows: list[list[str]]) -> str:
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
    out = _table(decode_header, rows)
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
        out += "\nPrefill (one prompt, batch 1, admission to first token):\n\n" + _table(prefill_header, rows)
    return out + "\n" + _settings(data["settings"]) + "\n"


def render_policies(data: dict) -> str:
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
            "| blocking vs on-demand | KiB/token | bytes vs on-demand | prefetch precision | TPOT ms |"
        )
        out.append("|" + "---|" * 10)
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
            out.append(
                f"| {r['policy']} | {r['hit_rate']:.3f} | {vs_oracle} | {vs_lru} | "
                f"{r['blocking_ms_per_token']:.2f} | {blk} | {r['bytes_per_token'] / 1024:.0f} | {byt} | "
                f"{prec} | {r['tpot_ms']:.2f} |"
            )
        out.append("")
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
