"""Seeded training loop of the bundled tiny MoE, and the checkpoint writer.

Pipeline (:func:`train`): corpus split -> BPE tokenizer on training text -> one token stream per
domain (EOS after every document) -> ``steps`` AdamW steps on random windows, every batch holding
the same number of rows from each domain -> bf16 ``save_pretrained`` + tokenizer files +
``training_log.json`` (curve, held-out losses, settings, timings).

NOTE: load balancing. transformers' built-in auxiliary loss pools the expert counts of all layers
before the Switch product, so one layer's imbalance can hide behind another's. We add our own
per-layer Switch loss (Fedus et al. 2021, eq. 4): for layer ``l`` with token share ``f_lj`` (top-k
assignments) and mean router probability ``P_lj``, ``E * sum_j f_lj P_lj`` (1.0 when balanced),
averaged over layers and scaled by ``aux_loss_coef``. It is computed over the whole batch — all
four domains — so experts stay busy overall while remaining free to specialise by domain.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moeserve.train.corpus import DOMAINS, CorpusSplit, Doc
from moeserve.train.shape import TinyMoeShape, TrainSettings, build_config, new_model, param_split
from moeserve.train.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer

TOKENIZER_SAMPLE_CHARS = 1_500_000  # per domain
LOG_NAME = "training_log.json"


def tokenizer_sample(docs: dict[str, list[Doc]], chars: int = TOKENIZER_SAMPLE_CHARS) -> list[str]:
    """The first ~``chars`` characters of each domain's training documents (equal weight)."""
    out = []
    for domain in DOMAINS:
        total = 0
        for d in docs[domain]:
            if total >= chars:
                break
            out.append(d.text)
            total += len(d.text)
    return out


def encode_streams(tok, docs: dict[str, list[Doc]], eos_id: int) -> dict[str, np.ndarray]:
    """One ``uint16`` token stream per domain: every document followed by EOS. Shape ``[n_tokens]``."""
    streams = {}
    for domain in DOMAINS:
        encs = tok.encode_batch([d.text for d in docs[domain]])
        ids = [np.asarray(e.ids + [eos_id], dtype=np.uint16) for e in encs]
        streams[domain] = np.concatenate(ids)
    return streams


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """``n`` evenly spaced windows of ``seq_len + 1`` tokens. Shape ``[n, seq_len + 1]``, int64."""
    span = seq_len + 1
    starts = np.linspace(0, len(stream) - span, num=n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + span] for s in starts]).astype(np.int64))


def sample_batch(
    streams: dict[str, np.ndarray], rng: np.random.Generator, batch_size: int, seq_len: int
) -> torch.Tensor:
    """Random windows, ``batch_size // len(DOMAINS)`` rows per domain. Shape ``[B, seq_len + 1]``."""
    rows = []
    per = batch_size // len(DOMAINS)
    for domain in DOMAINS:
        stream = streams[domain]
        for s in rng.integers(0, len(stream) - seq_len - 1, size=per):
            rows.append(stream[s : s + seq_len + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Per-layer Switch load-balancing loss, averaged over layers (1.0 when perfectly balanced).

    Args:
        router_logits: per MoE layer ``[tokens, E]`` router logits.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        num_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices  # [N, k]
        share = (
            torch.zeros(num_experts, device=probs.device).scatter_add_(
                0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)
            )
            / chosen.numel()
        )
        losses.append(num_experts * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. ``logits [B, T, V]``, ``targets [B, T]``."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], chunk: int = 8) -> dict[str, float]:
    """Held-out next-token loss per domain (nats/token) on fixed windows."""
    model.eval()
    out = {}
    for domain, w in windows.items():
        total, count = 0.0, 0
        for i in range(0, len(w), chunk):
            x = w[i : i + chunk]
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
            total += lm_loss(logits, x[:, 1:]).item() * x[:, 1:].numel()
            count += x[:, 1:].numel()
        out[domain] = total / count
    model.train()
    return out


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model, s: TrainSettings) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
    )


def save_checkpoint(model, tok, out_dir: Path, shape: TinyMoeShape, eos_id: int) -> None:
    """bf16 ``config.json`` + ``model.safetensors`` + ``generation_config.json`` + tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = None
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)
    save_tokenizer(tok, out_dir, model_max_length=shape.max_position_embeddings)


def train(
    split: CorpusSplit,
    out_dir: Path,
    shape: TinyMoeShape | None = None,
    settings: TrainSettings | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the tiny MoE on ``split`` and write the checkpoint folder ``out_dir``.

    Returns:
        The training log (also written to ``out_dir/training_log.json``).
    """
    import transformers

    shape, s = shape or TinyMoeShape(), settings or TrainSettings()
    torch.set_num_threads(s.threads)
    t_start = time.time()
    tok = train_tokenizer(tokenizer_sample(split.train), shape.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    train_streams = encode_streams(tok, split.train, eos_id)
    held_streams = encode_streams(tok, split.heldout, eos_id)
    windows = {d: eval_windows(held_streams[d], s.eval_windows, s.seq_len) for d in DOMAINS}
    t_data = time.time() - t_start
    log(
        f"tokenizer + streams in {t_data:.0f} s; train tokens "
        + ", ".join(f"{d}={len(v):,}" for d, v in train_streams.items())
    )

    config = build_config(shape, eos_id, s.aux_loss_coef)
    model = new_model(config, s.seed)
    counts = param_split(model)
    opt = _optimizer(model, s)
    rng = np.random.default_rng(s.seed)
    curve: list[dict[str, float]] = []
    evals = [{"step": 0, **evaluate(model, windows)}]
    log(f"step 0 held-out {evals[-1]}")
    t_loop = time.time()
    model.train()
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x = sample_batch(train_streams, rng, s.batch_size, s.seq_len)
        out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        loss = lm_loss(out.logits, x[:, 1:])
        aux = balance_loss(out.router_logits, shape.top_k)
        (loss + s.aux_loss_coef * aux).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % s.log_every == 0 or done == s.steps:
            elapsed = time.time() - t_loop
            curve.append(
                {
                    "step": done,
                    "loss": loss.item(),
                    "aux": aux.item(),
                    "lr": lr_at(step, s),
                    "grad_norm": float(grad_norm),
                    "elapsed_s": elapsed,
                }
            )
            log(
                f"step {done}/{s.steps} loss {loss.item():.3f} aux {aux.item():.3f} "
                f"{done * x[:, 1:].numel() / elapsed:.0f} tok/s"
            )
        if done % s.eval_every == 0 or done == s.steps:
            evals.append({"step": done, **evaluate(model, windows)})
            log(
                f"step {done} held-out "
                + ", ".join(f"{k}={v:.3f}" for k, v in evals[-1].items() if k != "step")
            )
    train_s = time.time() - t_loop
    save_checkpoint(model, tok, out_dir, shape, eos_id)
    result = {
        "shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
        "settings": s.as_dict(),
        "params": counts,
        "corpus": split.stats,
        "train_tokens_per_domain": {d: int(len(v)) for d, v in train_streams.items()},
        "heldout_tokens_per_domain": {d: int(len(v)) for d, v in held_streams.items()},
        "tokens_seen": s.steps * s.batch_size * s.seq_len,
        "curve": curve,
        "evals": evals,
        "time_s": {"data": t_data, "train": train_s, "total": time.time() - t_start},
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": s.threads,
            "experts_implementation": "eager",
        },
    }
    (out_dir / LOG_NAME).write_text(json.dumps(result, indent=1) + "\n")
    return result
