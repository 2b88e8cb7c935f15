"""Turning hybrid expert execution on for an engine: threads, kernels, probes, the fixed set.

:func:`attach` is what the engine calls after building its buffer: for ``--expert-compute cpu`` or
``auto`` it starts the CPU pool, checks which kernels split over it bit for bit
(:meth:`~moe_runtime.hybrid.executor.CPUExpertExecutor.check_split`), measures the kernels on the
store's experts with the whole pool on each expert (:func:`choose_kernels`), probes one copy over
each link and the device's time per expert, fills the buffer with its fixed set in ``cpu`` mode
and attaches the placer to the buffer.

``cpu`` mode's fixed set (llama.cpp's ``--n-cpu-moe N`` keeps the first N layers' experts on the
CPU): each device's slots hold the last experts homed on it in layer order (the last layers whole,
then part of the one before), loaded once at start; nothing is copied after.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moe_runtime.hybrid.cost_model import LinearCost
from moe_runtime.hybrid.executor import CPUExpertExecutor
from moe_runtime.hybrid.kernel_choice import KernelChoice, choose_kernels, eligible_kernels
from moe_runtime.hybrid.placement import HybridPlacer

#: the larger row count of the load-time fits (the CPU kernels' and the device's)
FIT_ROWS = 32


def default_threads(cpu_threads: int | None, io_threads: int) -> int:
    """CPU expert threads when ``--cpu-expert-threads`` is not given: the cores this process may
    run on, less the compute thread's intra-op threads (``cpu_threads``; None: torch's count) and
    the I/O threads (one per device), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    compute = cpu_threads if cpu_threads is not None else torch.get_num_threads()
    return max(1, cores - compute - io_threads)


def fit_from(rows: tuple[int, ...], seconds: list[float]) -> LinearCost:
    """A :class:`LinearCost` through the first and last ``(rows, seconds)`` points (no negative
    slope)."""
    r0, r1, s0, s1 = rows[0], rows[-1], seconds[0], seconds[-1]
    per_row = max(0.0, (s1 - s0) / (r1 - r0)) if r1 > r0 else 0.0
    return LinearCost(max(0.0, s0 - per_row * r0), per_row, prior_rows=max(2, r1))


def probe_link(buffer: Any) -> list[float]:
    """Per partition, one expert copy's seconds: the emulated link's time where one is set, else
    a copy of expert ``key`` into slot 0, timed by the partition's copy engine (CUDA events, or
    the memcpy). Call before the slots hold anything (slot 0 is overwritten)."""
    out = []
    for part in buffer.parts:
        if part.link is not None:
            out.append(part.link.transfer_seconds(buffer.store.expert_nbytes))
            continue
        key = int(np.flatnonzero(buffer.home == part.index)[0])
        # the partition's device for the probe only: the calling thread's current device stays
        cuda = part.device.type == "cuda"
        with torch.cuda.device(part.device) if cuda else contextlib.nullcontext():
            part.copier.copy(part.slots[0], buffer.store.expert(key), None)  # the first is warm-up
            out.append(part.copier.copy(part.slots[0], buffer.store.expert(key), None))
    return out


def probe_device(buffer: Any, dtype: torch.dtype, repeats: int = 3) -> LinearCost:
    """The device's seconds per expert at 1 and :data:`FIT_ROWS` rows: slot 0 of the first
    partition (holding an expert since :func:`probe_link`) run as the device path runs a slot,
    synchronised on CUDA."""
    part = buffer.parts[0]
    dev = part.device
    h = buffer.store.hidden_size
    secs = []
    with torch.inference_mode():
        for rows in (1, FIT_ROWS):
            x = torch.randn(rows, h, device=dev).to(dtype)
            times = []
            for i in range(repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                gate, up = F.linear(x, part.gate_up[0]).chunk(2, dim=-1)
                F.linear(F.silu(gate) * up, part.down[0])
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i:
                    times.append(time.perf_counter() - t0)
            secs.append(statistics.median(times))
    return fit_from((1, FIT_ROWS), secs)


def fixed_keys(buffer: Any, part: Any) -> list[int]:
    """``cpu`` mode's fixed set on ``part``: the last experts homed on it, in layer order, as many
    as its slots hold (the runtime and the simulator both preload these)."""
    homed = np.flatnonzero(buffer.home == part.index).tolist()
    return homed[-part.num_slots :]


def preload_fixed(buffer: Any) -> None:
    """``cpu`` mode: fill each partition's slots with the last experts homed on it in layer order
    (see the module note), once."""
    store = buffer.store
    for part in buffer.parts:
        keys = fixed_keys(buffer, part)
        for s, key in enumerate(keys):
            part.slots[s].copy_(store.expert(key))
        part.preload(keys)
    for dev in {p.device for p in buffer.parts if p.device.type == "cuda"}:
        torch.cuda.synchronize(dev)


def measure_pool(
    store: Any, threads: int, helps: bool = True, device: torch.device | None = None
) -> tuple[CPUExpertExecutor, LinearCost]:
    """A pool of ``threads`` over ``store`` with its kernels chosen and the CPU lane's line: every
    eligible kernel timed on the whole pool working on one expert at 1, 4 and :data:`FIT_ROWS`
    rows (``helps``: with the waiting thread taking units too, as it does at run time; ``device``:
    the engine's, the pool threads' current CUDA device). Returns the executor (``close()`` it)
    and the fit."""
    executor = CPUExpertExecutor(store, None, threads, helps=helps, device=device)
    kernels = eligible_kernels(store)
    executor.check_split(kernels)
    choice: KernelChoice = choose_kernels(store, (1, 4, FIT_ROWS), kernels=kernels, run=executor.run_one)
    executor.set_choice(choice)
    return executor, fit_from(choice.points, choice.seconds_chosen)


def attach(buffer: Any, runtime: Any, mode: str) -> HybridPlacer | None:
    """Turn hybrid execution on for ``buffer`` in ``mode`` (``cpu`` or ``auto``; ``device``, or a
    buffer holding every expert: nothing to do, None). Returns the placer (``close()`` it)."""
    if mode == "device" or buffer.all_resident:
        return None
    threads = runtime.cpu_expert_threads or default_threads(runtime.cpu_threads, len(buffer.parts))
    # the compute thread helps its CPU experts where it runs one OpenMP thread, as the pool's do
    executor, cpu_cost = measure_pool(
        buffer.store, threads, helps=runtime.cpu_threads == 1, device=runtime.torch_device
    )
    link_s = probe_link(buffer)
    device_cost = probe_device(buffer, buffer.store.compute_dtype)
    if mode == "cpu":
        preload_fixed(buffer)
    placer = HybridPlacer(
        buffer,
        mode,
        executor,
        cpu_cost,
        device_cost,
        device_timed=buffer.parts[0].device.type == "cpu",
        link_probe_s=link_s,
    )
    buffer.placer = placer
    return placer


def describe(placer: HybridPlacer | None, runtime: Any, mode: str) -> str:
    """The load summary's words on expert compute: the placer's, or why there is none; on a CPU
    device without an emulated link, that the modes compute alike."""
    alike = runtime.torch_device.type == "cpu" and runtime.link_gbps is None
    note = " (CPU device, no link: the modes compute alike)" if alike else ""
    if placer is None:
        why = "" if mode == "device" else " (every expert resident: nothing to place)"
        return f"expert compute {mode}{why}{note}"
    return placer.describe() + note
