"""Planned memory of a model under given runtime settings, checked against what is available.

Computed from ``config.json`` and the settings alone, before anything is allocated, so that a
checkpoint that cannot fit is refused with the numbers instead of dying in a huge allocation (or
being killed by the OOM killer half-way through loading).

The plan counts the large, long-lived allocations:

- **host**: the expert store, ``L * E * 3 * I * H`` elements in the runtime dtype, or ``L * E``
  packed quantized experts (``--expert-dtype``, :mod:`moe_runtime.quant`: their data and scales);
- **compute device**: the dense weights (embeddings, attention, norms, routers, shared experts, LM
  head; gpt-oss's attention sinks, o/router biases and resident expert biases), the expert
  buffer's slots (none when one CPU device holds every expert: the slots are the store itself) and
  the paged KV cache, ``num_kv_blocks * KVLayout.bytes_per_block`` (``--num-kv-blocks``, else
  :func:`kv_num_blocks`: the memory of ``max_batch_size`` sequences of ``max_model_len``
  positions, a sliding-window layer's window where shorter, ``moe_runtime.layers.kv_cache``).

On CPU the device bytes come out of host memory too. Activations (:func:`activation_bytes`, an
estimate) count against the device's budget when the memory plan sizes the split
(:mod:`moe_runtime.memory_split`), not against host memory; the router lookahead's folded router
copies and allocator overhead are not counted (small next to the above). Available memory:
host, ``MemAvailable`` from ``/proc/meminfo``, lowered to the cgroup's limit minus its usage when
the process runs in a memory-limited cgroup (containers); CUDA, ``torch.cuda.mem_get_info`` per
device. Where neither source exists (not Linux) the host side is not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_runtime.buffer.placement import home_devices
from moe_runtime.config import ModelConfig, RuntimeConfig
from moe_runtime.errors import ConfigError, InsufficientMemoryError
from moe_runtime.layers.attention import EXPAND_GQA
from moe_runtime.layers.kv_cache import KVLayout
from moe_runtime.models.base import expected_dense_shapes
from moe_runtime.quant import expert_layout

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def buffer_slot_count(runtime: RuntimeConfig, total_experts: int) -> int:
    """Expert slots the buffer holds in total: ``--buffer-slots``, else ``ceil(fraction * total)``,
    else (neither set, and no memory plan fixed them: :mod:`moe_runtime.memory_split`) every
    expert; at most ``total_experts`` and at least 1."""
    if runtime.buffer_slots:
        wanted = runtime.buffer_slots
    elif runtime.buffer_fraction is not None:
        wanted = max(1, math.ceil(runtime.buffer_fraction * total_experts))
    else:
        wanted = total_experts
    return min(total_experts, wanted)


def kv_cache_len(cfg: ModelConfig, runtime: RuntimeConfig) -> int:
    """Most positions per sequence: ``--max-model-len``, else the model's context capped at 4096."""
    return runtime.max_model_len or min(cfg.max_position_embeddings, 4096)


def kv_layout(cfg: ModelConfig, runtime: RuntimeConfig) -> KVLayout:
    """The paged KV cache's block layout for ``cfg`` under ``runtime`` (``--block-size``)."""
    return KVLayout.build(
        cfg.num_layers,
        runtime.block_size,
        cfg.kv_elements_per_token,
        kv_cache_len(cfg, runtime),
        cfg.layer_windows,
    )


def kv_num_blocks(cfg: ModelConfig, runtime: RuntimeConfig) -> int:
    """KV blocks in the pool: ``--num-kv-blocks``, else ``KVLayout.default_num_blocks`` (the static
    layout's memory of ``--max-batch-size`` sequences of ``--max-model-len`` positions).

    Raises:
        ConfigError: ``--num-kv-blocks`` below what one ``max_model_len`` sequence needs.
    """
    layout = kv_layout(cfg, runtime)
    max_len, step = kv_cache_len(cfg, runtime), runtime.max_num_batched_tokens
    if runtime.num_kv_blocks is None:
        return layout.default_num_blocks(runtime.max_batch_size, max_len, step)
    least = layout.min_num_blocks(max_len, step)
    if runtime.num_kv_blocks < least:
        raise ConfigError(
            f"--num-kv-blocks {runtime.num_kv_blocks} cannot hold one sequence of --max-model-len "
            f"{max_len} (it needs {least} blocks of {runtime.block_size} tokens); raise it or lower "
            "--max-model-len"
        )
    return runtime.num_kv_blocks


def engine_devices(runtime: RuntimeConfig) -> list[torch.device]:
    """The device of each buffer partition: for several CUDA devices the compute device and the
    ones after it (``--device cuda:2 --num-devices 2`` on four GPUs: ``cuda:2, cuda:3``; indices
    wrap around), else ``--num-devices`` copies of ``--device`` (emulated devices on the CPU).

    Raises:
        ConfigError: more CUDA devices asked for than the machine has.
    """
    device = runtime.torch_device
    if device.type == "cuda" and runtime.num_devices > 1:
        count = torch.cuda.device_count()
        if runtime.num_devices > count:
            raise ConfigError(f"--num-devices {runtime.num_devices}: this machine has {count} CUDA device(s)")
        return [torch.device("cuda", (device.index + i) % count) for i in range(runtime.num_devices)]
    return [device] * runtime.num_devices


def itemsize(runtime: RuntimeConfig) -> int:
    """Bytes per element of the runtime dtype."""
    return torch.empty((), dtype=runtime.torch_dtype).element_size()


def dense_bytes(cfg: ModelConfig, runtime: RuntimeConfig) -> int:
    """Bytes of the dense weights on the compute device."""
    return sum(math.prod(s) for s in expected_dense_shapes(cfg).values()) * itemsize(runtime)


def expert_bytes(cfg: ModelConfig, runtime: RuntimeConfig) -> int:
    """Bytes of one packed expert (one slot) in the format experts are kept in."""
    layout = expert_layout(cfg, runtime)
    return layout.nbytes if layout else cfg.expert_numel * itemsize(runtime)


def activation_bytes(cfg: ModelConfig, runtime: RuntimeConfig) -> int:
    """Estimated peak bytes of one step's live tensors on the compute device, for a step of
    ``--max-num-batched-tokens`` tokens ``T`` and ``--max-batch-size`` sequences ``B``:

    - per token, in the runtime dtype: 5 hidden-wide vectors (residual, norm, attention output,
      MoE output, the expert rows' outputs summed), the query and the new K/V (or latent), and per
      routed choice the expert's ``[gate | up]`` and activation (``3 I``) and output (``H``), plus
      a dense or shared MLP's ``3 I`` where the model has one; 16 bytes per choice of ids and
      weights;
    - one layer's K and V of ``B`` sequences of ``--max-model-len`` positions, gathered for
      attention (the gather path, CPU and CUDA prefill; ``kv_cache.py``), and SDPA's working copy:
      on CUDA the K/V heads repeated to the query heads (``attention.sdpa_gqa``; the latent, one
      head, to every query head), elsewhere one more copy;
    - ``B`` rows of fp32 logits over the vocabulary, twice (the sampler's working copy);
    - on CUDA with decode graphs, what the graphs of batch sizes ``1..B`` keep between replays:
      each whole-step graph its ``[b, V]`` fp32 logits, each layer's attention-block graph four
      ``[b, H]`` tensors (``engine/decode_graphs.py``, ``layers/attention_graphs.py``).

    Attention scores are not counted (SDPA's flash and memory-efficient kernels do not make them),
    nor the allocator's fragmentation: ``--gpu-memory-utilization`` leaves that headroom.
    """
    size = itemsize(runtime)
    t, b = runtime.max_num_batched_tokens, runtime.max_batch_size
    h, k, i = cfg.hidden_size, cfg.top_k, cfg.moe_intermediate_size
    q = cfg.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim if cfg.mla else cfg.head_dim)
    mlp = max(cfg.dense_intermediate_size, cfg.shared_expert_intermediate_size)
    per_token = (5 * h + q + cfg.kv_elements_per_token + k * (3 * i + h) + 3 * mlp) * size + 16 * k
    # SDPA's copy per gathered element: the query heads per K/V head where the heads are repeated
    kv_heads = 1 if cfg.mla else cfg.num_kv_heads
    repeat = cfg.num_heads // kv_heads if EXPAND_GQA.get(runtime.torch_device.type, False) else 1
    gathered = (1 + repeat) * b * kv_cache_len(cfg, runtime) * cfg.kv_elements_per_token * size
    logits = 2 * min(b, t) * cfg.vocab_size * 4
    graphs = 0
    if runtime.torch_device.type == "cuda" and runtime.cuda_graphs:
        rows = b * (b + 1) // 2  # every batch size 1..B captures its own
        graphs = rows * (cfg.vocab_size * 4 + cfg.num_layers * 4 * h * size)
    return t * per_token + gathered + logits + graphs


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the runtime will allocate for one model (see the module docstring for what counts).

    Attributes:
        expert_store: host expert store.
        dense: dense weights, on the compute device.
        kv_cache: the paged KV cache's block pool, on the compute device.
        buffer_slots: expert slots per buffer partition (device), in partition order.
        slot_bytes: bytes of one slot (= one packed expert, quantized or not); 0 when the slots
            alias the store.
        devices: device of each partition; ``compute`` is the device of dense weights and KV cache.
        expert_bytes: bytes of one packed expert (a slot's size even where the slots alias the store).
        activations: :func:`activation_bytes`, on ``compute`` (not in :meth:`per_device`, which
            counts allocations).
    """

    expert_store: int
    dense: int
    kv_cache: int
    buffer_slots: tuple[int, ...]
    slot_bytes: int
    devices: tuple[torch.device, ...]
    compute: torch.device
    expert_bytes: int = 0
    activations: int = 0

    @property
    def buffer(self) -> int:
        """Bytes of every expert slot together."""
        return sum(self.buffer_slots) * self.slot_bytes

    def slots_per_device(self) -> dict[torch.device, int]:
        """Expert slots on each device (partitions of one device summed)."""
        slots: dict[torch.device, int] = {}
        for dev, n in zip(self.devices, self.buffer_slots, strict=True):
            slots[dev] = slots.get(dev, 0) + n
        return slots

    def per_device(self) -> dict[torch.device, int]:
        """Bytes on each device: dense and KV cache on ``compute``, slots on their partition's."""
        need = {self.compute: self.dense + self.kv_cache}
        for dev, n in self.slots_per_device().items():
            need[dev] = need.get(dev, 0) + n * self.slot_bytes
        return need

    @property
    def host(self) -> int:
        """Host bytes: the expert store plus whatever lives on CPU "devices"."""
        return self.expert_store + sum(b for d, b in self.per_device().items() if d.type == "cpu")


def partition_slots(
    runtime: RuntimeConfig, num_layers: int, num_experts: int, slots: int | None = None
) -> tuple[int, ...]:
    """Slots of each buffer partition, as :class:`~moe_runtime.buffer.ExpertBuffer` sizes them:
    ``ceil(slots / n)`` each (every expert when all are resident), never more than the experts
    homed on the partition, at least 1. ``slots``: the total (default :func:`buffer_slot_count`).
    Beyond 2^20 experts the homes are not hashed (it would cost memory) and each partition is
    assumed to home them all: an upper bound."""
    total = num_layers * num_experts
    slots = buffer_slot_count(runtime, total) if slots is None else min(slots, total)
    n = runtime.num_devices
    per = total if slots >= total else math.ceil(slots / n)
    return tuple(max(1, min(per, h)) for h in homed_experts(num_layers, num_experts, n))


def homed_experts(num_layers: int, num_experts: int, n: int) -> list[int]:
    """Experts homed on each of ``n`` partitions (all of them on each beyond 2^20 experts)."""
    total = num_layers * num_experts
    if n > 1 and total <= 1 << 20:
        return np.bincount(home_devices(num_layers, num_experts, n), minlength=n).tolist()
    return [total] * n


def plan_memory(cfg: ModelConfig, runtime: RuntimeConfig) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``cfg`` under ``runtime`` (arithmetic only, allocates nothing)."""
    total = cfg.num_moe_layers * cfg.num_experts
    one = expert_bytes(cfg, runtime)
    devices = engine_devices(runtime)
    parts = partition_slots(runtime, cfg.num_moe_layers, cfg.num_experts)
    alias = len(devices) == 1 and devices[0].type == "cpu" and parts[0] >= total and runtime.link_gbps is None
    kv = kv_num_blocks(cfg, runtime) * kv_layout(cfg, runtime).bytes_per_block(itemsize(runtime))
    return MemoryPlan(
        expert_store=total * one,
        dense=dense_bytes(cfg, runtime),
        kv_cache=kv,
        buffer_slots=parts,
        slot_bytes=0 if alias else one,
        devices=tuple(devices),
        compute=runtime.torch_device,  # indexed, as engine_devices' (one key per GPU)
        expert_bytes=one,
        activations=activation_bytes(cfg, runtime),
    )


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) reads as None


def host_available() -> tuple[int, str] | None:
    """``(bytes, source)`` of host memory this process can still allocate, or None if unknown.

    ``MemAvailable`` (``/proc/meminfo``: free memory plus reclaimable caches), lowered to the
    cgroup's ``limit - usage`` when a memory limit is set (cgroup v2 ``memory.max``/
    ``memory.current``, else v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``).
    """
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    for root, limit_file, usage_file in (
        (CGROUP_V2, "memory.max", "memory.current"),
        (CGROUP_V1, "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes ~2^63 for none
            found.append((max(0, limit - usage), f"cgroup {root / limit_file}"))
            break
    return min(found) if found else None


def device_available(device: torch.device) -> int:
    """Free bytes on a CUDA device (``torch.cuda.mem_get_info``)."""
    return torch.cuda.mem_get_info(device)[0]


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"1.50 GiB"``, ``"0 B"``)."""
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def check_memory(plan: MemoryPlan, source: str) -> None:
    """Refuse a plan that does not fit, before anything is allocated.

    Args:
        plan: from :func:`plan_memory`.
        source: what the plan is for (the model folder), named first in the message.

    Raises:
        InsufficientMemoryError: one line with the needed and available bytes and their parts.
    """
    host = host_available()
    if host is not None and plan.host > host[0]:
        parts = {"expert store": plan.expert_store}
        if plan.compute.type == "cpu":
            parts.update({"dense": plan.dense, "KV cache": plan.kv_cache, "buffer": plan.buffer})
        hint = (
            "; lower --num-kv-blocks, --max-batch-size or --max-model-len"
            if max(parts.values()) == plan.kv_cache
            else ""
        )
        listed = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items())
        raise InsufficientMemoryError(
            f"{source}: the model needs {human_bytes(plan.host)} of host memory ({listed}), "
            f"only {human_bytes(host[0])} is available ({host[1]}){hint}"
        )
    slots = plan.slots_per_device()
    for dev, need in plan.per_device().items():
        free = device_available(dev) if dev.type == "cuda" else need
        if need > free:
            parts = [f"{slots.get(dev, 0)} expert slots {human_bytes(slots.get(dev, 0) * plan.slot_bytes)}"]
            if dev == plan.compute:
                parts[:0] = [f"dense {human_bytes(plan.dense)}", f"KV cache {human_bytes(plan.kv_cache)}"]
            raise InsufficientMemoryError(
                f"{source}: {dev} needs {human_bytes(need)} ({', '.join(parts)}), only {human_bytes(free)} "
                "is free; lower --buffer-slots/--buffer-fraction, --num-kv-blocks, --max-batch-size or "
                "--max-model-len"
            )
