"""Held-out loss of a checkpoint with its experts as the runtime keeps them in each
``--expert-dtype``: the bundled model's held-out windows (the training recipe's, rebuilt from the
corpus), transformers' forward pass in fp32, and every routed expert replaced by the runtime's
stored expert dequantized (:meth:`moe_runtime.store.HostExpertStore.dequant`), so the loss is that
of exactly the weights the runtime serves (the runtime itself equals transformers on those
weights: tests/test_quant_runtime.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: Formats measured by default: the checkpoint's own (bf16 for the bundled model), then quantized.
FORMATS = ("auto", "bf16", "fp8", "int8", "mxfp4")


def heldout_windows(model_dir: Path, data_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """Per domain the training recipe's held-out windows ``[n, seq_len + 1]`` (the settings in
    the checkpoint's ``training_log.json``; corpus rebuilt from ``data_dir``, default
    ``../shared/data``).

    Raises:
        ConfigError: no corpus data (:func:`moeserve.train.corpus.build_corpus`).
    """
    from tokenizers import Tokenizer

    from moeserve.train.corpus import DOMAINS, build_corpus
    from moeserve.train.tokenizer import EOS_TOKEN
    from moeserve.train.trainer import LOG_NAME, encode_streams, eval_windows

    s = json.loads((model_dir / LOG_NAME).read_text())["settings"]
    split = build_corpus(data_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    streams = encode_streams(tok, split.heldout, tok.token_to_id(EOS_TOKEN))
    return {d: eval_windows(streams[d], s["eval_windows"], s["seq_len"]) for d in DOMAINS}


def model_with_served_experts(model_dir: Path, expert_dtype: str) -> tuple[Any, str, int]:
    """A transformers fp32 model of ``model_dir`` whose routed experts are the runtime's stored
    experts under ``--expert-dtype expert_dtype``, dequantized to fp32; with the format's
    description and bytes per expert.

    Raises:
        ConfigError: a model whose experts transformers does not keep as fused ``gate_up_proj``
            ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` parameters.
    """
    from transformers import AutoModelForCausalLM

    from moe_runtime.config import RuntimeConfig
    from moe_runtime.errors import ConfigError
    from moe_runtime.loader import load_checkpoint

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    loaded = load_checkpoint(model_dir, RuntimeConfig(expert_dtype=expert_dtype), load_tokenizer=False)
    store, cfg = loaded.store, loaded.config
    with torch.no_grad():
        for li, layer in enumerate(cfg.moe_layers):
            experts = getattr(model.model.layers[layer].mlp, "experts", None)
            if not hasattr(experts, "gate_up_proj"):
                raise ConfigError(
                    f"{model_dir}: layer {layer} has no fused experts.gate_up_proj in transformers"
                )
            for e in range(cfg.num_experts):
                gate, up, down = (store.dequant(li, e, part).float() for part in ("gate", "up", "down"))
                experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
                experts.down_proj[e].copy_(down)
    name = store.layout.describe() if store.layout else str(store.compute_dtype).removeprefix("torch.")
    return model.eval(), name, store.expert_nbytes


def measure(
    model_dir: Path, windows: dict[str, torch.Tensor], formats: tuple[str, ...] = FORMATS
) -> dict[str, Any]:
    """Held-out loss (nats/token) per domain and their mean for each format, and the mean's rise
    over the first format (``auto``: the checkpoint's experts as stored) in percent."""
    from moeserve.train.trainer import evaluate

    rows = []
    for fmt in formats:
        model, name, nbytes = model_with_served_experts(model_dir, fmt)
        losses = evaluate(model, windows)
        mean = sum(losses.values()) / len(losses)
        rows.append(
            {"expert_dtype": fmt, "format": name, "expert_bytes": nbytes, "loss": losses, "mean": mean}
        )
    base = rows[0]["mean"]
    for r in rows:
        r["rise_percent"] = 100 * (r["mean"] - base) / base
    return {
        "model": model_dir.name,
        "windows": {d: list(w.shape) for d, w in windows.items()},
        "torch": torch.__version__,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    """The Markdown table of :func:`measure`'s result."""
    domains = list(result["rows"][0]["loss"])
    head = ["--expert-dtype", "experts kept as", "bytes/expert", *domains, "mean", "rise vs auto"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["expert_dtype"], r["format"], f"{r['expert_bytes']:,}"]
        cells += [f"{r['loss'][d]:.4f}" for d in domains] + [f"{r['mean']:.4f}", f"{r['rise_percent']:+.2f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    windows = ", ".join(f"{d} {n} x {t - 1}" for d, (n, t) in result["windows"].items())
    return (
        "\n".join(lines) + f"\n\nHeld-out windows (tokens predicted): {windows}; torch {result['torch']}.\n"
    )
