"""Bandwidths that bound a decode step: device memory (HBM) from a table, links measured.

HBM: :func:`hbm_gbps` names the CUDA device (``torch.cuda.get_device_name``) and looks its memory
bandwidth up in :data:`CUDA_GPUS`, which reuses the simulator's data-sheet profiles
(:mod:`moeserve.sim.hardware`, sources there) and adds the data-sheet figures of a few more
cards (sources below). On the CPU, "HBM" is the host's memory: a measured copy bandwidth.

Link: :func:`h2d_gbps` measures host->device copies of one expert's size in this process: on CUDA
from pinned memory on a separate stream, timed with CUDA events (what the I/O thread does); on
the CPU a plain memcpy (what the CPU copy engine does).

Decimal units throughout: 1 GB/s = 1e9 bytes/s, as data sheets count.
"""

from __future__ import annotations

import time

import torch

from moe_runtime.device import normalize_device
from moe_runtime.errors import ConfigError
from moeserve.sim.hardware import GPUS, GiB, GPUProfile

_EXTRA = {
    # NVIDIA H100 PCIe (80 GB HBM2e): 2.0 TB/s (NVIDIA H100 Tensor Core GPU data sheet, "H100 PCIe").
    "h100-pcie": GPUProfile("h100-pcie", 80 * GiB, 756e12, 2000.0, "NVIDIA H100 data sheet (PCIe)"),
    # NVIDIA H100 NVL (94 GB HBM3): 3.9 TB/s (NVIDIA H100 data sheet, "H100 NVL").
    "h100-nvl": GPUProfile("h100-nvl", 94 * GiB, 835e12, 3900.0, "NVIDIA H100 data sheet (NVL)"),
    # NVIDIA H200 (141 GB HBM3e): 4.8 TB/s, SXM and NVL alike (NVIDIA H200 Tensor Core GPU data sheet).
    "h200": GPUProfile("h200", 141 * GiB, 989e12, 4800.0, "NVIDIA H200 data sheet"),
    # NVIDIA A100 40GB SXM: HBM2 1,555 GB/s (NVIDIA A100 data sheet).
    "a100-40gb": GPUProfile("a100-40gb", 40 * GiB, 312e12, 1555.0, "NVIDIA A100 data sheet (40GB)"),
    # NVIDIA L40S: 48 GB GDDR6, 864 GB/s (NVIDIA L40S data sheet).
    "l40s": GPUProfile("l40s", 48 * GiB, 362e12, 864.0, "NVIDIA L40S data sheet"),
}
CUDA_GPUS: dict[str, GPUProfile] = {**GPUS, **_EXTRA}

# (substrings all found in torch.cuda.get_device_name(), profile); the first match wins, so more
# specific names come first ("NVIDIA GH200 480GB" contains "H200").
NAME_PATTERNS: list[tuple[tuple[str, ...], str]] = [
    (("GH200",), "gh200-96gb"),
    (("H200",), "h200"),
    (("H100", "PCIe"), "h100-pcie"),
    (("H100", "NVL"), "h100-nvl"),
    (("H100",), "h100-80gb"),  # "NVIDIA H100 80GB HBM3" = SXM5
    (("A100", "40GB"), "a100-40gb"),
    (("A100",), "a100-80gb"),
    (("L40S",), "l40s"),
    (("A5000",), "a5000"),
]


def gpu_profile(device_name: str) -> GPUProfile | None:
    """The table's profile for a ``torch.cuda.get_device_name()`` string, or None."""
    for needles, key in NAME_PATTERNS:
        if all(n in device_name for n in needles):
            return CUDA_GPUS[key]
    return None


def _fastest(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls after a warm-up: a bound wants the best rate the
    hardware reaches, and on a shared host the slower runs measure other work."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_copy_gbps(nbytes: int = 128 << 20, repeats: int = 5) -> float:
    """Host memory bandwidth, GB/s: a ``nbytes`` tensor copy counted as read + write (STREAM's
    convention), fastest of ``repeats``."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _fastest(lambda: dst.copy_(src), repeats) / 1e9


def hbm_gbps(device: torch.device, override: float | None = None) -> tuple[float, str]:
    """Device memory bandwidth, GB/s, and where it comes from.

    ``override`` (``--hbm-gbps``) wins; CUDA: :data:`CUDA_GPUS` by device name; CPU: measured
    :func:`cpu_copy_gbps`.

    Raises:
        ConfigError: a CUDA device the table does not know and no override.
    """
    if override is not None:
        if override <= 0:
            raise ConfigError(f"--hbm-gbps {override}: must be > 0")
        return override, "--hbm-gbps"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        prof = gpu_profile(name)
        if prof is None:
            raise ConfigError(
                f"--device {device}: {name!r} is not in the HBM table "
                f"({', '.join(CUDA_GPUS)}); pass --hbm-gbps"
            )
        return prof.hbm_gbps, f"{name}: {prof.source}"
    return cpu_copy_gbps(), "measured host memory copy (read + write)"


def h2d_gbps(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Measured host->device copy bandwidth for ``nbytes`` copies, GB/s (fastest of ``repeats``).

    CUDA: pinned source, ``non_blocking`` copy on a side stream, CUDA events. CPU: memcpy.
    """
    nbytes = max(int(nbytes), 1)
    if device.type != "cuda":
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return nbytes / _fastest(lambda: dst.copy_(src), repeats) / 1e9
    device = normalize_device(device)  # plain "cuda": the current device
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    times = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        if i:  # the first copy is a warm-up
            times.append(start.elapsed_time(end) / 1e3)
    return nbytes / min(times) / 1e9
