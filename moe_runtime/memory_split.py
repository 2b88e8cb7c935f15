"""The memory plan's split: how much of the device goes to KV blocks and how much to expert slots.

vLLM, SGLang and llama.cpp page their KV caches and give the memory left after the weights to it;
here the experts do not fit, so the same memory also buys expert slots, and the split is chosen by
what each byte buys.

**Budget** (:func:`device_budgets`): on CUDA, ``--gpu-memory-utilization`` (0.9) of the device's
memory (``--device-memory`` if given, else ``torch.cuda.mem_get_info``'s total), never more than
is free when the model loads; on the CPU, that share of ``--device-memory`` (the "device" is host
memory; without ``--device-memory`` there is no plan: every expert resident unless
``--buffer-slots``/``--buffer-fraction`` say otherwise, the KV pool its default, as before).

**Fixed part**: the dense weights and the activations of a ``--max-num-batched-tokens`` step
(:func:`moe_runtime.memory_plan.activation_bytes`). Less than the fixed part, one
``--max-model-len`` sequence's blocks and one slot per partition does not fit: a one-line
:class:`InsufficientMemoryError` with the numbers.

**Objective** (:func:`resolve_split`): the split of the rest that maximises expected decode
throughput, ``C / T(C, S)`` tokens/s, over the concurrency ``C`` from 1 to ``--max-batch-size``:

- KV blocks buy concurrency: ``C`` sequences at the traffic's p90 length (prompt plus output,
  :mod:`moe_runtime.plan_data`: the Azure conversation trace's, or recorded traffic's), at least
  one ``--max-model-len`` sequence; the slots get what is left (at most every expert).
- Slots buy hits: ``T`` is MoE-Lightning's HRM (§3.2, §4.2: memory roofs only, a decode step being
  memory-bound) for one decode step, ``(dense + KV read + hits x expert) / device bandwidth +
  misses x (expert / link bandwidth + latency)``, with hits and misses from the routing's curve
  (:mod:`moe_runtime.hit_curve`). Bandwidths (:func:`hardware`): ``--link-gbps`` or 25 GB/s
  (PCIe 4.0 x16 at 80%, the simulator's figure) on CUDA, 10 GB/s (a host memcpy) on the CPU;
  device memory 2 TB/s on CUDA (H100 PCIe; the device's own when torch reports its clock and bus),
  20 GB/s on the CPU. Assumptions, stated: they weigh the terms, they do not predict TPOT.

A larger ``C`` spreads the batch over more experts and takes slots away, so past some ``C`` a
sequence costs more in misses than it adds; with every expert resident ``T`` grows slowly and the
batch wins. The largest ``C`` within :data:`TOLERANCE` (10%) of the best is chosen: the model
leaves out the per-step host costs a larger batch amortises. Memory left after the chosen split
goes to KV blocks, up to ``--max-batch-size`` sequences of ``--max-model-len`` (more would only
keep cached prefixes).

**Overrides**: ``--buffer-slots``/``--buffer-fraction`` fix the slots (KV takes the rest, up to that
cap); ``--num-kv-blocks``/``--kv-cache-memory`` fix the pool (slots take the rest); both: checked
against the budget. Every outcome is within the budget, or refused with the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from moe_runtime.config import ModelConfig, RuntimeConfig
from moe_runtime.errors import ConfigError, InsufficientMemoryError
from moe_runtime.memory_plan import (
    activation_bytes,
    buffer_slot_count,
    dense_bytes,
    engine_devices,
    expert_bytes,
    homed_experts,
    human_bytes,
    itemsize,
    kv_cache_len,
    kv_layout,
)
from moe_runtime.plan_data import PlanData, read_plan_data

#: Concurrencies tried beyond this many are a geometric grid (plus the batch itself).
MAX_CANDIDATES = 48
#: Length quantile KV blocks are sized for.
LENGTH_QUANTILE = 0.9
#: The largest concurrency whose estimated throughput is within this share of the best is chosen:
#: the model leaves out the per-step host costs a larger batch amortises, and its bandwidths are
#: assumptions, so only a clear gain buys slots with concurrency.
TOLERANCE = 0.1


@dataclass(frozen=True)
class Hardware:
    """Bandwidths (bytes/s) and per-copy latency (s) that weigh the HRM step time; ``source``."""

    device_bw: float
    link_bw: float
    latency_s: float
    source: str


def hardware(runtime: RuntimeConfig, cuda: bool | None = None) -> Hardware:
    """The bandwidths of the module docstring for ``runtime``'s compute device (``cuda``: take it
    for a CUDA device, or not, whatever ``--device`` says: the unit tests' real shapes)."""
    dev = runtime.torch_device if cuda is None else torch.device("cuda" if cuda else "cpu")
    latency = runtime.link_latency_us * 1e-6
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev) if dev.index is not None else None
        clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        device_bw = 2 * clock * 1e3 * bus / 8 if clock and bus else 2e12  # DDR: two transfers per clock
        link = runtime.link_gbps or 25.0
        return Hardware(
            device_bw, link * 1e9, latency, f"device {device_bw / 1e9:.0f} GB/s, link {link:g} GB/s"
        )
    link = runtime.link_gbps or 10.0
    return Hardware(20e9, link * 1e9, latency, f"host memory 20 GB/s, link {link:g} GB/s")


def measure_devices(runtime: RuntimeConfig) -> dict[str, tuple[int, int]]:
    """``(free, total)`` bytes of each CUDA device the engine will use (``mem_get_info``), taken
    before the model loads: the budget is fixed then."""
    return {str(d): torch.cuda.mem_get_info(d) for d in set(engine_devices(runtime)) if d.type == "cuda"}


def device_budgets(
    runtime: RuntimeConfig, measured: dict[str, tuple[int, int]] | None = None
) -> dict[torch.device, tuple[int, str]]:
    """Device -> ``(bytes the plan may take, how they were found)``; empty when there is no plan
    (the CPU without ``--device-memory``). ``measured``: :func:`measure_devices`' figures (taken
    now where missing)."""
    util = runtime.gpu_memory_utilization
    budgets = {}
    for dev in set(engine_devices(runtime)):
        if dev.type == "cuda":
            free, total = (measured or {}).get(str(dev)) or torch.cuda.mem_get_info(dev)
            total = runtime.device_memory or total
            words = f"{util:.2f} x {human_bytes(total)} of {dev}"
            # the (1 - util) share stays free whatever others hold: CUDA's own workspaces, kernels
            # loaded late, captured graphs and the allocator's fragmentation are not in the plan
            share = int(util * total)
            budget = max(0, min(share, free - (total - share)))
            if budget < share:
                words += f", capped: {human_bytes(free)} free less {1 - util:.2f} x the device kept back"
            budgets[dev] = (budget, words)
        elif runtime.device_memory is not None:
            budgets[dev] = (
                int(util * runtime.device_memory),
                f"{util:.2f} x --device-memory {human_bytes(runtime.device_memory)}",
            )
    return budgets


@dataclass(frozen=True)
class MemorySplit:
    """The plan's outcome.

    Attributes:
        runtime: the settings with ``buffer_slots`` and ``num_kv_blocks`` fixed where a plan ran
            (else as given, ``--kv-cache-memory`` turned into blocks).
        planned: a device budget was known and the split was made against it.
        budget, budget_source: bytes on the compute device and how they were found.
        dense, activations, kv, slots_bytes: the compute device's parts, bytes.
        slots, total_experts, num_kv_blocks: the split.
        hit_rate: the curve's estimate at the chosen split (None when nothing was weighed).
        why: what decided the split, for the load summary.
    """

    runtime: RuntimeConfig
    planned: bool
    budget: int = 0
    budget_source: str = ""
    dense: int = 0
    activations: int = 0
    kv: int = 0
    slots_bytes: int = 0
    slots: int = 0
    total_experts: int = 0
    num_kv_blocks: int = 0
    hit_rate: float | None = None
    why: str = ""

    def describe(self) -> str:
        """Two lines (empty without a plan): the split, then why."""
        if not self.planned:
            return ""
        used = self.dense + self.activations + self.kv + self.slots_bytes
        hit = f", est. hit rate {self.hit_rate:.2f}" if self.hit_rate is not None else ""
        return (
            f"memory plan: {human_bytes(used)} of {human_bytes(self.budget)} ({self.budget_source}): "
            f"dense {human_bytes(self.dense)}, activations {human_bytes(self.activations)}, KV cache "
            f"{human_bytes(self.kv)} ({self.num_kv_blocks} blocks), {self.slots} expert slots "
            f"{human_bytes(self.slots_bytes)} ({100 * self.slots / self.total_experts:.0f}% of "
            f"{self.total_experts} experts{hit})\nmemory plan why: {self.why}"
        )


class _Sizes:
    """The byte arithmetic of one model under one runtime: what fits where."""

    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, budgets: dict) -> None:
        self.cfg, self.runtime, self.budgets = cfg, runtime, budgets
        self.layout = kv_layout(cfg, runtime)
        self.block = self.layout.bytes_per_block(itemsize(runtime))
        self.expert = expert_bytes(cfg, runtime)
        self.total = cfg.num_moe_layers * cfg.num_experts
        self.dense, self.activations = dense_bytes(cfg, runtime), activation_bytes(cfg, runtime)
        self.compute = runtime.torch_device
        self.devices = engine_devices(runtime)
        self.homed = homed_experts(cfg.num_moe_layers, cfg.num_experts, runtime.num_devices)
        self.max_len = kv_cache_len(cfg, runtime)
        self.min_blocks = self.layout.min_num_blocks(self.max_len, runtime.max_num_batched_tokens)
        self.cap_blocks = self.layout.default_num_blocks(
            runtime.max_batch_size, self.max_len, runtime.max_num_batched_tokens
        )

    def slots_on(self, slots: int) -> dict[torch.device, int]:
        """Slots on each device for ``slots`` in total (as ``partition_slots``)."""
        per = self.total if slots >= self.total else math.ceil(slots / len(self.devices))
        out: dict[torch.device, int] = {}
        for dev, h in zip(self.devices, self.homed, strict=True):
            out[dev] = out.get(dev, 0) + max(1, min(per, h))
        return out

    def need(self, blocks: int, slots: int) -> dict[torch.device, int]:
        """Bytes on each device (slots counted at an expert's size even where they alias the store)."""
        need = {dev: n * self.expert for dev, n in self.slots_on(slots).items()}
        fixed = self.dense + self.activations + blocks * self.block
        need[self.compute] = need.get(self.compute, 0) + fixed
        return need

    def fits(self, blocks: int, slots: int) -> bool:
        need = self.need(blocks, slots)
        return all(need.get(dev, 0) <= b for dev, (b, _) in self.budgets.items())

    def max_slots(self, blocks: int) -> int:
        """Most slots that fit beside ``blocks`` (0: not even one per partition)."""
        if not self.fits(blocks, 1):
            return 0
        lo, hi = 1, self.total
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(blocks, mid) else (lo, mid - 1)
        return lo

    def max_blocks(self, slots: int) -> int:
        """Most blocks that fit beside ``slots`` (0 when the slots alone do not fit)."""
        if not self.fits(0, slots):
            return 0
        budget = self.budgets[self.compute][0] if self.compute in self.budgets else 0
        return max(0, (budget - self.need(0, slots)[self.compute]) // self.block)


def resolve_split(
    cfg: ModelConfig,
    runtime: RuntimeConfig,
    measured: dict[str, tuple[int, int]] | None = None,
    source: str = "",
    data: PlanData | None = None,
    hw: Hardware | None = None,
) -> MemorySplit:
    """Fix ``runtime``'s slots and KV blocks by the plan of the module docstring.

    Args:
        measured: device memory taken before the load (:func:`measure_devices`).
        source: the model folder, named first in an error.
        data: the traffic (default: read from ``runtime.plan_data``, else the built-in defaults).
        hw: the bandwidths (default :func:`hardware`).

    Raises:
        InsufficientMemoryError: the fixed part with one sequence and one slot, or the settings the
            user fixed, exceed the budget (one line with the numbers).
        ConfigError: an unreadable ``--plan-data`` file, or a pool below one sequence.
    """
    budgets = device_budgets(runtime, measured)
    sizes = _Sizes(cfg, runtime, budgets)
    if runtime.kv_cache_memory is not None:
        runtime = replace(runtime, num_kv_blocks=runtime.kv_cache_memory // sizes.block, kv_cache_memory=None)
        if runtime.num_kv_blocks < sizes.min_blocks:
            raise ConfigError(
                f"--kv-cache-memory holds {runtime.num_kv_blocks} blocks of {human_bytes(sizes.block)}: "
                f"one sequence of --max-model-len {sizes.max_len} needs {sizes.min_blocks}"
            )
    if not budgets:
        return MemorySplit(runtime, planned=False)
    prefix = f"{source}: " if source else ""
    fixed_slots = runtime.buffer_slots is not None or runtime.buffer_fraction is not None
    slots = buffer_slot_count(runtime, sizes.total) if fixed_slots else None
    blocks = runtime.num_kv_blocks
    if not sizes.fits(blocks or sizes.min_blocks, slots or 1):
        raise InsufficientMemoryError(prefix + _too_small(sizes, blocks, slots))
    hit_rate = None
    if slots is not None and blocks is not None:
        why = "--buffer-slots/--buffer-fraction and the KV pool are both fixed; they fit"
    elif slots is not None:
        blocks = min(sizes.cap_blocks, sizes.max_blocks(slots))
        why = (
            f"--buffer-slots/--buffer-fraction fix {slots} slots; the KV cache takes the rest, at most "
            f"--max-batch-size {runtime.max_batch_size} sequences of --max-model-len {sizes.max_len}"
        )
    elif blocks is not None:
        slots = sizes.max_slots(blocks)
        why = f"the KV pool is fixed at {blocks} blocks; the expert slots take the rest"
    else:
        data = data or read_plan_data(runtime.plan_data, cfg.num_moe_layers, cfg.num_experts, cfg.top_k)
        blocks, slots, hit_rate, why = _best_split(sizes, data, hw or hardware(runtime))
    return MemorySplit(
        replace(runtime, buffer_slots=slots, num_kv_blocks=blocks),
        planned=True,
        budget=budgets[sizes.compute][0] if sizes.compute in budgets else 0,
        budget_source=budgets[sizes.compute][1] if sizes.compute in budgets else "",
        dense=sizes.dense,
        activations=sizes.activations,
        kv=blocks * sizes.block,
        slots_bytes=sum(sizes.slots_on(slots).values()) * sizes.expert,
        slots=min(slots, sizes.total),
        total_experts=sizes.total,
        num_kv_blocks=blocks,
        hit_rate=hit_rate,
        why=why,
    )


def _too_small(sizes: _Sizes, blocks: int | None, slots: int | None) -> str:
    """The one-line refusal: what the smallest plan needs against the budget."""
    need = sizes.need(blocks or sizes.min_blocks, slots or 1)
    dev = max(need, key=lambda d: need[d] - sizes.budgets.get(d, (need[d], ""))[0])
    budget, words = sizes.budgets[dev]
    n_slots = sizes.slots_on(slots or 1).get(dev, 0)
    parts = [f"{n_slots} expert slot{'s' if n_slots != 1 else ''} {human_bytes(n_slots * sizes.expert)}"]
    if dev == sizes.compute:
        kv = (
            f"KV cache {human_bytes(blocks * sizes.block)} (--num-kv-blocks {blocks})"
            if blocks
            else f"one {sizes.max_len}-token sequence's KV cache "
            f"{human_bytes(sizes.min_blocks * sizes.block)}"
        )
        parts[:0] = [
            f"dense weights {human_bytes(sizes.dense)}",
            f"activations {human_bytes(sizes.activations)} for --max-num-batched-tokens "
            f"{sizes.runtime.max_num_batched_tokens}",
            kv,
        ]
    what = "the settings given need" if blocks or slots else "the dense part alone needs"
    return (
        f"the memory plan may take {human_bytes(budget)} of {dev} ({words}), but {what} "
        f"{human_bytes(need[dev])} ({', '.join(parts)}); raise --gpu-memory-utilization or use a larger "
        "device, or lower --max-num-batched-tokens, --max-model-len, --num-kv-blocks or --buffer-slots"
    )


def _candidates(batch: int) -> list[int]:
    """Concurrencies tried: every one up to :data:`MAX_CANDIDATES`, else a geometric grid."""
    if batch <= MAX_CANDIDATES:
        return list(range(1, batch + 1))
    grid = {round(batch ** (i / (MAX_CANDIDATES - 1))) for i in range(MAX_CANDIDATES)}
    return sorted(grid | {1, batch})


def _best_split(sizes: _Sizes, data: PlanData, hw: Hardware) -> tuple[int, int, float, str]:
    """``(blocks, slots, hit rate, why)`` of the highest expected decode throughput."""
    runtime, layout = sizes.runtime, sizes.layout
    seq_len = data.lengths.quantile(LENGTH_QUANTILE, sizes.max_len)
    mean_len = data.lengths.mean(sizes.max_len)
    per_seq = layout.blocks_per_sequence(seq_len)
    kv_read = layout.blocks_per_sequence(max(1, round(mean_len))) * sizes.block
    copy_s = sizes.expert / hw.link_bw + hw.latency_s
    rows = []  # (throughput, C, blocks, slots, hit rate)
    for c in _candidates(runtime.max_batch_size):
        blocks = max(sizes.min_blocks, c * per_seq)
        slots = sizes.max_slots(blocks)
        if slots < 1:
            break
        demand = data.routing.demand(c)
        hits, misses = demand.hits(slots), demand.misses(slots)
        step_s = (sizes.dense + c * kv_read + hits * sizes.expert) / hw.device_bw + misses * copy_s
        rows.append((c / step_s, c, blocks, slots, demand.hit_rate(slots)))
    top = max(r[0] for r in rows)
    thr, c, blocks, slots, hit = max((r for r in rows if r[0] >= (1 - TOLERANCE) * top), key=lambda r: r[1])
    blocks = max(blocks, min(sizes.cap_blocks, sizes.max_blocks(slots)))
    full, one = rows[-1], rows[0]
    others = f"; {full[1]} would leave {full[3]} slots: {full[0]:,.1f}" if full[1] != c else ""
    if c != 1:  # the latency side of the trade: TPOT is C / throughput
        others += f"; 1 sequence: {one[0]:,.1f} tok/s, TPOT {_ms(1 / one[0])} ms"
    why = (
        f"highest est. decode throughput (MoE-Lightning's HRM over 1..{runtime.max_batch_size} sequences; "
        f"{hw.source}): {c} sequences of {seq_len} tokens (p90, {data.lengths.source}) in the KV cache, "
        f"the rest in slots at the hit-rate curve of {data.routing.source}: {thr:,.1f} tok/s, TPOT "
        f"{_ms(c / thr)} ms{others}"
    )
    return blocks, min(slots, sizes.total), hit, why


def split_for(loaded, runtime: RuntimeConfig) -> MemorySplit:
    """The split of a loaded model (``moe_runtime.loader.LoadedModel``) under ``runtime``: the
    loader's when it planned for the same settings, else planned again against the device memory
    measured before the load."""
    if getattr(loaded, "memory_split", None) is not None and getattr(loaded, "runtime", None) == runtime:
        return loaded.memory_split
    return resolve_split(loaded.config, runtime, getattr(loaded, "device_memory", None), str(loaded.path))


def _ms(seconds: float) -> str:
    """Milliseconds, whole from 10 up, else two significant digits."""
    ms = 1e3 * seconds
    return f"{ms:,.0f}" if ms >= 10 else f"{ms:.2g}"
