"""Random weights in place of a checkpoint's (``--load-format dummy``, as vLLM's dummy format).

With it a model is served or measured from its ``config.json`` alone: no weight files are read,
so a real shape (``moeserve make-checkpoint --config-only``) costs no disk and no time to write
or read tens of gigabytes. Its outputs are meaningless; its speed is the model's.

Values, as ``moeserve make-checkpoint`` draws them: every matrix ``N(0, INITIALIZER_RANGE)`` (the
configs' ``initializer_range``), norms 1, biases, attention sinks and router score biases 0, and
routers ``N(0, ROUTER_LOGIT_STD / sqrt(hidden))``, so that a unit-RMS hidden state gives router
logits of std ``ROUTER_LOGIT_STD`` and routing depends on the input (at 0.02 it is close to
uniform). Seeded: the same seed gives the same weights on any number of cores (each chunk of
``CHUNK`` values has its own generator; torch lets go of the interpreter lock while it draws, so
the chunks run on every core).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import torch

INITIALIZER_RANGE = 0.02
ROUTER_LOGIT_STD = 3.0
CHUNK = 1 << 22  # values drawn from one generator (4 M: 8 MB in bf16)
SEED_STRIDE = 1_000_000  # generators per tensor (a tensor has fewer chunks than this)


def tensor_seed(seed: int, index: int, count: int) -> int:
    """The first generator seed of tensor ``index`` of ``count`` drawn under ``seed``: tensors
    :data:`SEED_STRIDE` seeds apart, so their chunks' generators never coincide."""
    return (seed * count + index) * SEED_STRIDE


def fill_normal(t: torch.Tensor, std: float, seed: int, pool: Executor) -> torch.Tensor:
    """Fill the contiguous ``t`` with ``N(0, std)`` in chunks of :data:`CHUNK` values on ``pool``'s
    threads, chunk ``i`` from a generator seeded ``seed + i``; returns ``t``."""
    flat = t.view(-1)

    def chunk(i: int) -> None:
        g = torch.Generator().manual_seed(seed + i)
        flat[i * CHUNK : (i + 1) * CHUNK].normal_(0.0, std, generator=g)

    list(pool.map(chunk, range(-(-flat.numel() // CHUNK))))
    return t


def dense_init(name: str, hidden: int) -> tuple[str, float]:
    """How a dense tensor is drawn, by its canonical name (``layers.3.router``): ``("fill", 0.0)``
    for a bias, attention sinks or a router's score bias, ``("fill", 1.0)`` for a norm's weight,
    else ``("normal", std)``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias") or leaf == "sinks":
        return "fill", 0.0
    if leaf.endswith("norm"):
        return "fill", 1.0
    return "normal", ROUTER_LOGIT_STD / math.sqrt(hidden) if leaf == "router" else INITIALIZER_RANGE


def random_weights(
    family: Any, cfg: Any, want: dict[str, tuple[int, ...]], store: Any, runtime: Any, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The dense tensors ``{name: tensor}`` (shapes ``want``, on the runtime's device in the
    family's dtype) and every expert of ``store`` filled (see the module docstring).

    Plain experts are drawn straight into the store; quantized ones (``--expert-dtype``) are drawn
    one matrix at a time and quantized as a checkpoint's would be (slower: one core quantizes)."""
    dtype, device = runtime.torch_dtype, runtime.torch_device
    dense: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for j, (name, shape) in enumerate(want.items()):
            t = torch.empty(shape, dtype=dtype)
            how, value = dense_init(name, cfg.hidden_size)
            if how == "fill":
                t.fill_(value)
            else:
                fill_normal(t, value, tensor_seed(seed, j, len(want) + 1), pool)
            dense[name] = family.dense_tensor(name, t).to(
                device=device, dtype=family.dense_dtype(name, dtype)
            )
        expert_seed = tensor_seed(seed, len(want), len(want) + 1)  # the store: the last tensor
        if store.layout is None:
            fill_normal(store.data, INITIALIZER_RANGE, expert_seed, pool)
            store.mark_filled()
            return dense
        h, i = store.hidden_size, store.intermediate_size
        for key in range(store.num_layers * store.num_experts):
            for part in ("gate", "up", "down"):
                shape = (h, i) if part == "down" else (i, h)
                m = fill_normal(torch.empty(shape, dtype=dtype), INITIALIZER_RANGE, expert_seed, pool)
                expert_seed += SEED_STRIDE
                store.write(key // store.num_experts, key % store.num_experts, part, m, "random weights")
    return dense
