"""PNG plots of a replay run and of a rate sweep (matplotlib, Agg backend; nothing is shown).

* :func:`plot_run` -> ``replay-latency.png``: per-request TTFT and e2e latency against send time
  (with the arrival rate per second behind them), and the CDF of TPOT.
* :func:`plot_sweep` -> ``sweep-latency.png`` (TPOT and TTFT percentiles vs offered rate, the shape
  of MoE-Infinity Figure 9) and ``sweep-hitrate.png`` (expert buffer hit rate vs offered rate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from clients.http import RequestRecord


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(records: list[RequestRecord], out: Path, title: str) -> Path | None:
    """Latency timeline and TPOT CDF of one run; ``None`` when no request succeeded."""
    ok = [r for r in records if r.ok and r.sent_s is not None and r.ttft_s is not None]
    if not ok:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    sent = np.array([r.sent_s for r in ok])
    span = max(r.sent_s or 0.0 for r in records)
    width = max(1.0, span / 40.0)  # seconds per bar: about 40 bars over the run
    bins = np.arange(0.0, span + 2 * width, width)
    count, _ = np.histogram([r.sent_s for r in records if r.sent_s is not None], bins=bins)
    ax0 = ax1.twinx()
    ax0.bar(bins[:-1], count / width, width=width, align="edge", color="0.9", zorder=0)
    ax0.set_ylabel(f"requests sent per second ({width:.3g} s bins)", color="0.5")
    ax1.set_zorder(ax0.get_zorder() + 1)
    ax1.patch.set_visible(False)
    ax1.plot(sent, [r.ttft_s * 1e3 for r in ok], ".", ms=4, label="TTFT")
    ax1.plot(sent, [(r.e2e_s or 0.0) * 1e3 for r in ok], "x", ms=3, alpha=0.6, label="e2e")
    ax1.set_yscale("log")
    ax1.set_xlabel("send time (s)")
    ax1.set_ylabel("latency (ms)")
    ax1.legend(loc="upper left")
    ax1.grid(alpha=0.3)
    tpot = np.sort([r.tpot_s * 1e3 for r in ok if r.tpot_s is not None])
    if len(tpot):
        ax2.plot(tpot, np.arange(1, len(tpot) + 1) / len(tpot), "-")
    ax2.set_xlabel("TPOT (ms)")
    ax2.set_ylabel("fraction of requests")
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out / "replay-latency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(rows: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    """``sweep-latency.png`` and ``sweep-hitrate.png`` from :func:`clients.sweep.sweep_rows` rows."""
    plt = _pyplot()
    # x = the rate actually offered (a trace window's local rate differs from the target --rps)
    x = [r["offered_rps"] if r["offered_rps"] is not None else r["rps"] for r in rows]

    def ys(key: str) -> list[float]:
        return [float("nan") if r[key] is None else r[key] for r in rows]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
        ax1.plot(x, ys(f"tpot_{p}_ms"), style, label=f"TPOT {p}")
        ax2.plot(x, ys(f"ttft_{p}_ms"), style, label=f"TTFT {p}")
    ax2.set_yscale("log")  # queueing makes TTFT span orders of magnitude past saturation
    for ax, name in ((ax1, "TPOT (ms)"), (ax2, "TTFT (ms)")):
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    lat = out / "sweep-latency.png"
    fig.savefig(lat, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(x, ys("hit_rate"), "o-")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("expert buffer hit rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    hit = out / "sweep-hitrate.png"
    fig.savefig(hit, dpi=120)
    plt.close(fig)
    return [lat, hit]
