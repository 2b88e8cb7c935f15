"""Figures of the tiny MoE's model card (``docs/img/model-card-*.png``), drawn with matplotlib.

Inputs are the training log (``training_log.json``) and the routing analysis of
:func:`moeserve.train.model_card.analyse`; paper reference curves come from
:data:`moeserve.train.routing_analysis.PAPER_TABLE1` / ``PAPER_FIG2_MEAN`` (MoE-Infinity
Table 1 and Figure 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moeserve.train import routing_analysis as ra
from moeserve.train.corpus import DOMAINS

LABELS = {
    "trained": "trained",
    "random": "random init",
    "random_forced": "random init, trained's tokens",
    "uniform": "uniform routing",
}


def plot_all(log: dict[str, Any], a: dict[str, Any], img_dir: Path) -> dict[str, str]:
    """Draw the four card figures into ``img_dir``; returns figure key -> file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    files = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [c["step"] for c in log["curve"]],
        [c["loss"] for c in log["curve"]],
        lw=1,
        color="0.6",
        label="train batch (all domains)",
    )
    for d in DOMAINS:
        ax.plot(
            [e["step"] for e in log["evals"]],
            [e[d] for e in log["evals"]],
            marker="o",
            ms=3,
            label=f"held-out {d}",
        )
    ax.set(xlabel="step", ylabel="next-token loss (nats)", title="Training curve", ylim=(0, None))
    ax.legend(fontsize=8)
    files["training"] = _save(fig, img_dir / "model-card-training.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("trained", "o"), ("random", "x")):  # prompts are the same for both
        ax.scatter(
            a[name]["prompt_len"],
            100 * np.array(a[name]["prefill_ratio"]),
            marker=style,
            s=18,
            label=f"{LABELS[name]}: mean {100 * np.mean(a[name]['prefill_ratio']):.1f} %",
        )
    lengths = np.arange(1, max(a["trained"]["prompt_len"]) + 1)
    cfg_k, cfg_e = log["shape"]["top_k"], log["shape"]["num_experts"]
    ax.plot(
        lengths,
        [100 * ra.uniform_ratio(cfg_e, cfg_k, n) for n in lengths],
        color="0.5",
        ls="--",
        label="uniform routing",
    )
    for name, value in ra.PAPER_FIG2_MEAN.items():
        ax.axhline(value, color="red", lw=0.8, ls=":", label=f"paper Fig. 2 mean, {name}: {value:g} %")
    ax.set(
        xscale="log",
        xlabel="prompt length (tokens)",
        ylabel="experts used in prefill (%)",
        title="Prefill expert activation ratio per request (cf. MoE-Infinity Fig. 2)",
    )
    ax.legend(fontsize=7)
    files["prefill"] = _save(fig, img_dir / "model-card-prefill-ratio.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("trained", "random", "random_forced", "uniform"):
        bs = sorted(int(b) for b in a[name]["batch_ratio"])
        ax.plot(
            bs, [100 * a[name]["batch_ratio"][b] for b in bs], marker="o", label=f"tiny-moe {LABELS[name]}"
        )
    for name, (_, _, ratios) in ra.PAPER_TABLE1.items():
        ax.plot(ra.BATCH_SIZES, ratios, ls=":", marker=".", label=f"paper: {name}")
    ax.set(
        xscale="log",
        xlabel="batch size (requests)",
        ylabel="experts used per decode iteration (%)",
        title="Decode activation ratio vs batch size (cf. MoE-Infinity Table 1)",
    )
    ax.set_xticks(ra.BATCH_SIZES, [str(b) for b in ra.BATCH_SIZES])
    ax.legend(fontsize=7)
    files["batch"] = _save(fig, img_dir / "model-card-batch-ratio.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    layers = np.arange(len(a["trained"]["jsd_per_layer"]))
    for off, name in ((-0.2, "trained"), (0.2, "random")):
        ax1.bar(layers + off, a[name]["jsd_per_layer"], width=0.4, label=LABELS[name])
    for name in ("trained", "random", "random_forced"):
        share = 100 * np.array(a[name]["decode_top25_share_per_layer"])
        ax2.plot(layers, share, marker="o", label=LABELS[name])
    ax2.axhline(100 * a["uniform"]["decode_top25_share"], color="0.5", ls="--", label=LABELS["uniform"])
    ax1.set(xlabel="MoE layer", ylabel="JSD (bits)", title="Domain specialisation: mean pairwise JSD")
    ax2.set(xlabel="MoE layer", ylabel="share (%)", title="Decode reuse: top-25 % experts' share")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    files["routing"] = _save(fig, img_dir / "model-card-routing.png")
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name
