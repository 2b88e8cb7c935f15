"""Write a random-weight checkpoint of a real shape, one decoder layer at a time.

The model is built by ``transformers`` on the ``meta`` device (names and shapes, no memory); each
group of parameters (embeddings + final norm + LM head, then every decoder layer) is drawn, turned
into the on-disk layout by ``transformers``' own ``save_pretrained`` conversion
(``revert_weight_conversion``: fused expert tensors back to per-expert matrices) and written as one
safetensors shard, with the ``model.safetensors.index.json`` that ``from_pretrained`` reads. Peak
memory is two decoder layers (a Mixtral-8x7B layer is 2.8 GB in bf16), not the model: one being
drawn while the previous one is written.

Speed: the draws run on every core (``moe_runtime.dummy_weights.fill_normal``: chunks with their
own generators, seeded by the seed, the tensor's index and the chunk's, so the bytes do not depend
on the number of cores), and a shard is written in the background while the next group is drawn. One
core draws about 170 M normal values a second, so one thread took minutes for the 12 GB of
Mixtral-8x7B's first 4 layers.

Weights (the values ``--load-format dummy`` draws in memory, ``moe_runtime.dummy_weights``): every
matrix ``N(0, 0.02)`` (the configs' ``initializer_range``), norms 1, biases 0, and routers
``N(0, ROUTER_LOGIT_STD / sqrt(hidden))``: a unit-RMS hidden state then gives router logits of std
``ROUTER_LOGIT_STD``, so top-k margins are real and routing depends on the input (at 0.02 the
logits of a 2048-wide model have std 0.9 and routing is close to uniform).
:func:`routing_summary` measures it on the first MoE layer (after DeepSeek's and GLM-4.5's dense
ones), as a softmax over the router logits whatever the family's scoring.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_runtime.dummy_weights import INITIALIZER_RANGE, ROUTER_LOGIT_STD, fill_normal, tensor_seed
from moe_runtime.errors import ConfigError
from moeserve.checkpoints.shapes import EOS_ID, RealShape, hf_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class WriteReport:
    """What :func:`write_checkpoint` wrote. ``routing``: :func:`routing_summary` of the first MoE
    layer, plus its decoder-layer index as ``layer``."""

    out: Path
    total_bytes: int
    expert_bytes: int
    shards: int
    seconds: float
    routing: dict


def check_out_dir(out: Path) -> None:
    """Raises ConfigError if ``out`` is a file or a non-empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder")


def routing_summary(
    embed: torch.Tensor, router: torch.Tensor, top_k: int, tokens: int = 64, seed: int = 0
) -> dict:
    """Routing of ``tokens`` random token embeddings through one router (RMS-normalised input).

    Args:
        embed: ``[V, H]`` embedding matrix; router: ``[E, H]`` router weight.

    Returns:
        ``entropy``: mean softmax entropy over experts / ``ln E`` (1 = uniform routing);
        ``top1_share``: mean probability of the top expert; ``distinct_topk``: distinct top-k sets
        among the tokens; ``tokens``; ``experts_used``: experts in any token's top-k.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, embed.shape[0], (tokens,), generator=g)
    h = embed[ids].float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    probs = torch.softmax(h @ router.float().T, dim=-1)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1) / math.log(router.shape[0])
    top = probs.topk(top_k, dim=-1).indices.sort(dim=-1).values
    return {
        "entropy": round(float(ent.mean()), 4),
        "top1_share": round(float(probs.max(-1).values.mean()), 4),
        "distinct_topk": len({tuple(r) for r in top.tolist()}),
        "experts_used": int(top.unique().numel()),
        "tokens": tokens,
    }


def _groups(names: list[str], layers: int) -> list[list[str]]:
    """Parameter names split into [non-layer params, layer 0, layer 1, ...]."""
    out: list[list[str]] = [[] for _ in range(layers + 1)]
    for n in names:
        parts = n.split(".")
        idx = parts.index("layers") + 1 if "layers" in parts else None
        out[0 if idx is None else int(parts[idx]) + 1].append(n)
    return out


def _draw(
    name: str, shape: torch.Size, dtype: torch.dtype, real: RealShape, seed: int, pool: Executor
) -> torch.Tensor:
    """One parameter's values (module docstring); ``seed``: this tensor's; ``pool``: the threads
    that draw its chunks (torch lets go of the interpreter lock while it draws)."""
    t = torch.empty(shape, dtype=dtype)
    if name.endswith("bias"):
        return t.zero_()
    if len(shape) == 1 and "norm" in name:
        return t.fill_(1.0)
    std = ROUTER_LOGIT_STD / math.sqrt(real.hidden) if _is_router(name, shape, real) else INITIALIZER_RANGE
    return fill_normal(t, std, seed, pool)


def _is_router(name: str, shape: torch.Size, real: RealShape) -> bool:
    """A router weight ``[E, H]``: ``...gate.weight`` (most families) or ``...router.weight``
    (transformers' Phi-3.5-MoE and gpt-oss modules)."""
    leaf = name.rsplit(".", 2)
    return (
        tuple(shape) == (real.experts, real.hidden)
        and "experts" not in name
        and leaf[-1] == "weight"
        and leaf[-2] in ("gate", "router")
    )


def write_config_only(real: RealShape, layers: int, out: Path, dtype: str = "bf16") -> None:
    """``config.json``, ``generation_config.json`` and the tokenizer of ``real``'s first ``layers``
    decoder layers, no weights: a folder to serve or measure with ``--load-format dummy``.

    Raises:
        ConfigError: as :func:`write_checkpoint`.
    """
    _check_args(real, layers, out, dtype)
    out.mkdir(parents=True, exist_ok=True)
    _write_config_files(hf_config(real, layers, str(DTYPES[dtype]).removeprefix("torch.")), real, out)


def _check_args(real: RealShape, layers: int, out: Path, dtype: str) -> None:
    if not 1 <= layers <= real.num_layers:
        raise ConfigError(f"--layers {layers}: must be in 1..{real.num_layers} for {real.name}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    check_out_dir(out)


def _write_config_files(config, real: RealShape, out: Path) -> None:
    import transformers

    from moeserve.checkpoints.vocab import write_tokenizer

    config.save_pretrained(out)
    transformers.GenerationConfig(
        eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=None, do_sample=False
    ).save_pretrained(out)
    write_tokenizer(out, real.vocab, real.max_position_embeddings)


def write_checkpoint(
    real: RealShape,
    layers: int,
    out: Path,
    dtype: str = "bf16",
    seed: int = 0,
    log: Callable[[str], None] = lambda _m: None,
) -> WriteReport:
    """Write ``real``'s first ``layers`` decoder layers, random weights, to ``out``.

    Writes ``config.json``, ``generation_config.json``, ``model-0000i-of-0000n.safetensors`` (one
    shard for embeddings/norm/head, one per layer), ``model.safetensors.index.json``,
    ``tokenizer.json`` and ``tokenizer_config.json``. Seeded: the same arguments give the same bytes,
    on any number of cores.

    Raises:
        ConfigError: ``layers`` outside ``1..real.num_layers``, unknown ``dtype``, ``out`` not empty.
    """
    import transformers
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    _check_args(real, layers, out, dtype)
    t0 = time.perf_counter()
    torch_dtype = DTYPES[dtype]
    config = hf_config(real, layers, str(torch_dtype).removeprefix("torch."))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    params = dict(meta.state_dict())
    groups = _groups(list(params), layers)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = expert_total = 0
    embed = routing = None
    pending: Future | None = None  # the previous shard's write
    seeds = {n: tensor_seed(seed, j, len(params)) for j, n in enumerate(params)}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool, ThreadPoolExecutor(1) as writer:
        for i, names in enumerate(groups):
            sd = {n: _draw(n, params[n].shape, torch_dtype, real, seeds[n], pool) for n in names}
            if i == 0:
                embed = next(v for n, v in sd.items() if n.endswith("embed_tokens.weight"))
            elif routing is None:
                router = next((v for n, v in sd.items() if _is_router(n, v.shape, real)), None)
                if router is not None:  # the first MoE layer
                    routing = {**routing_summary(embed, router, real.top_k, seed=seed), "layer": i - 1}
                    embed = None
            disk = {k: v.contiguous() for k, v in revert_weight_conversion(meta, sd).items()}
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            if pending is not None:
                pending.result()  # at most one shard waiting to be written
            pending = writer.submit(save_file, disk, str(out / fname), metadata={"format": "pt"})
            for k, v in disk.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
                if ".experts." in k:
                    expert_total += v.numel() * v.element_size()
            log(f"  {fname}: {'embeddings, norm, LM head' if i == 0 else f'layer {i - 1}'}")
            del sd, disk
        if pending is not None:
            pending.result()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_config_files(config, real, out)
    return WriteReport(out, total, expert_total, len(groups), time.perf_counter() - t0, routing or {})
