"""Hardware profiles for the simulator: host->device links, GPUs and hosts (MoE-Lightning §3, HRM levels).

A :class:`HardwareProfile` is one GPU (memory, peak compute, HBM bandwidth: the compute and memory
roofs of the device level in MoE-Lightning's Hierarchical Roofline Model, Eqs. 4-5) behind one
host link (the cross-level memory roof, Eq. 6), in a host whose CPU socket can compute experts
from its own memory (the CPU level's roofs, Eqs. 1-3; hybrid expert execution,
:mod:`moeserve.sim.hybrid`). Every value carries its source in a comment and in
``docs/simulator.md``. Peak figures are the vendors' data-sheet numbers (dense, no sparsity);
achieved kernel throughput is lower, which the roofline ignores (MoE-Lightning §4.2 does the
same); calibration (:mod:`moeserve.sim.calibrate`) uses measured times instead.

Effective link bandwidth: PCIe moves 128b/130b-encoded data in packets whose headers and flow
control cost about 20% of the raw rate, so a pinned host->device copy reaches about 80% of it
(the ``~25 GB/s`` usually quoted for PCIe 4.0 x16). We apply the same 0.8 to every link, NVLink-C2C
included; this factor is our assumption, stated, not a measurement.

Host memory: a memory-bound kernel sustains about 80% of the DRAM channels' nominal rate (STREAM
Triad class; the nominal rate is channels x MT/s x 8 bytes; McCalpin: "75%-85% of the peak DRAM
bandwidth in each generation" of many-core servers). We use the sustained figure for the CPU's
expert time and the hybrid bound. One core reads far less (:data:`CORE_READ_GBPS`), so the
runtime splits each CPU expert over its whole pool: the pool reads at ``min(sustained, threads x
core rate)``. A host is the CPU socket (NUMA node) whose memory holds the GPU's experts:
MoE-Infinity partitions experts by NUMA node (§5.3), so a GPU's experts are read by that socket's
cores and channels.

Host compute: the data-sheet peak (``peak_flops``) times the share the runtime's CPU kernel
(torch's ``F.linear``: MKL or oneDNN) sustains on that instruction set (:data:`GEMM_EFFICIENCY`,
each with its basis), as the bandwidth is the nominal rate times 0.8.

Profiles are named ``gpu+link`` (``a5000+pcie4``); a few aliases name common servers.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.errors import ConfigError

GB = 1e9  # data-sheet "GB" and "GB/s" are decimal
GiB = 1 << 30
LINK_EFFICIENCY = 0.8  # share of the raw link rate a large pinned copy achieves (assumption, see above)
HOST_MEMORY_EFFICIENCY = 0.8  # share of the nominal DRAM rate a memory-bound kernel sustains (assumption)
# One core's read rate from DRAM, GB/s: measured on a 2-core EPYC host (AMD EPYC, Zen 4 under KVM:
# one thread summing its own 256 MiB fp32 tensor, moeserve bench cpu-experts' roof at --threads 1,
# 19-24 GB/s over the runs of docs/hybrid.md, median 22.5), assumed for every host. A single core's
# bandwidth is bound by its outstanding misses over the memory latency (McCalpin, "Single-core memory
# bandwidth: latency, bandwidth and concurrency", 2025), not by the channels, so it is of this order
# on every recent server core; it matters only for a pool of few threads.
CORE_READ_GBPS = 22.5
# Share of the data-sheet peak the runtime's CPU kernel (torch's F.linear) sustains, by instruction set.
# "amx": KTransformers' AMX kernel sustains 21 TFLOP/s BF16 on a 4th-gen Xeon, "about 4x faster than
#   PyTorch's general AMX kernel" (kvcache-ai/ktransformers doc/en/AMX.md; their SGLang integration
#   note: 21.3 TFLOP/s on one socket, 3.9x PyTorch's native path), so PyTorch's (oneDNN, what F.linear
#   runs) sustains 21.3 / 3.9 = 5.5 TFLOP/s; their benchmark socket is a Xeon Gold 6454S
#   (doc/en/DeepseekR1_V3_tutorial.md: 32 cores, 2.2 GHz base: 1024 x 32 x 2.2e9 = 72.1 TFLOP/s AMX
#   peak), so 5.5 / 72.1 = 0.076 (our reading of their figures: the SKU of the 21.3 is inferred).
# "fma": measured on a 2-core EPYC host (one AMD Zen 4 core, 2 FMA pipes of 256 bits = 32 FP32
#   FLOP/cycle, as the EPYC 7543's Zen 3; 2.6 GHz as the VM reports it: 83.2 GFLOP/s): torch fp32
#   F.linear (MKL sgemm) of 128 x 4096 by 8192 x 4096 (about a 512-token chunk's rows per Mixtral
#   expert), 40 calls in each of three runs: medians 72.2, 73.9, 76.2 GFLOP/s, so 73.9 / 83.2 = 0.89
#   (the host is shared: contended runs read lower). bf16 weights on cores without BF16 arithmetic
#   (Zen 2/3) are assumed to run at the FP32 rate (converted in registers, as oneDNN does).
GEMM_EFFICIENCY = {"amx": 0.076, "fma": 0.89}


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """A host->device link. ``raw_gbps``: per-direction signalling rate after line encoding, GB/s;
    ``latency_us``: fixed cost per transfer (DMA setup and launch), microseconds."""

    name: str
    raw_gbps: float
    latency_us: float
    source: str

    @property
    def gbps(self) -> float:
        """Effective bandwidth, GB/s (``raw_gbps * LINK_EFFICIENCY``)."""
        return self.raw_gbps * LINK_EFFICIENCY


@dataclass(frozen=True, slots=True)
class GPUProfile:
    """One accelerator: ``memory_bytes``; ``peak_flops`` (dense BF16/FP16 tensor FLOP/s);
    ``hbm_gbps`` (device memory bandwidth, GB/s)."""

    name: str
    memory_bytes: int
    peak_flops: float
    hbm_gbps: float
    source: str


@dataclass(frozen=True, slots=True)
class HostProfile:
    """The CPU socket beside a GPU: ``cores`` (physical) and ``threads`` (hardware threads);
    ``mem_gbps_nominal`` (DRAM channels x MT/s x 8 bytes, GB/s); ``peak_flops`` (data-sheet FLOP/s
    of the fastest instructions a BF16 expert's matrix products run on: AMX on Sapphire Rapids,
    FP32 FMA where the cores have no BF16 arithmetic); ``isa`` (``amx`` or ``fma``: which
    :data:`GEMM_EFFICIENCY` applies); ``expert_overhead_us`` (fixed host time per expert computed on
    the CPU: dispatching it, its ops' launches, its output's copy back; microseconds, an
    assumption), ``unit_overhead_us`` (Python time on the GIL per range of a split projection, which
    the pool's threads take in turn; microseconds, measured)."""

    name: str
    cores: int
    threads: int
    mem_gbps_nominal: float
    peak_flops: float
    isa: str
    expert_overhead_us: float
    unit_overhead_us: float
    source: str

    @property
    def mem_gbps(self) -> float:
        """Sustained memory bandwidth, GB/s (``mem_gbps_nominal * HOST_MEMORY_EFFICIENCY``)."""
        return self.mem_gbps_nominal * HOST_MEMORY_EFFICIENCY

    @property
    def sustained_flops(self) -> float:
        """FLOP/s the runtime's CPU kernel sustains on every core (``peak_flops`` x the ISA's
        :data:`GEMM_EFFICIENCY`)."""
        return self.peak_flops * GEMM_EFFICIENCY[self.isa]

    def pool_gbps(self, threads: int) -> float:
        """GB/s a pool of ``threads`` threads reads, all on one expert: the sustained bandwidth,
        at most ``threads x`` :data:`CORE_READ_GBPS`."""
        return min(self.mem_gbps, threads * CORE_READ_GBPS)

    def pool_flops(self, threads: int) -> float:
        """FLOP/s of a pool of ``threads`` threads (at most one per physical core)."""
        return self.sustained_flops * min(threads, self.cores) / self.cores

    def default_threads(self, io_threads: int = 1) -> int:
        """Host threads computing experts: the runtime's rule (``moe_runtime.hybrid.setup.
        default_threads``) for a GPU run with ``--cpu-threads 1`` (the compute thread launches
        kernels), counted in physical cores (an SMT sibling shares its core's memory bandwidth and
        FMA units, so it adds no reading or FLOPs): the cores less the compute thread and the I/O
        threads (one per device), at least 1."""
        return max(1, self.cores - 1 - io_threads)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.cores} cores, DRAM {self.mem_gbps_nominal:.1f} GB/s nominal, "
            f"{self.mem_gbps:.1f} sustained (x {HOST_MEMORY_EFFICIENCY}), "
            f"{self.peak_flops / 1e12:.1f} TFLOP/s peak, {self.sustained_flops / 1e12:.2f} sustained "
            f"({self.isa} x {GEMM_EFFICIENCY[self.isa]}), {self.expert_overhead_us:.0f} us per CPU expert "
            f"+ {self.unit_overhead_us:.0f} us per range"
        )


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A GPU behind a link, in a host; ``name`` is ``gpu+link`` or an alias."""

    name: str
    gpu: GPUProfile
    link: LinkProfile
    host: HostProfile | None = None

    def describe(self) -> str:
        g, lk = self.gpu, self.link
        return (
            f"{self.name}: {g.name} {g.memory_bytes / GiB:.0f} GiB, {g.peak_flops / 1e12:.0f} TFLOP/s, "
            f"HBM {g.hbm_gbps:.0f} GB/s; link {lk.name} {lk.gbps:.1f} GB/s effective "
            f"({lk.raw_gbps:.1f} raw x {LINK_EFFICIENCY}), {lk.latency_us:.0f} us/transfer"
        )


# Per-transfer latency: a cudaMemcpyAsync launch plus DMA setup is of order 10 us (assumption; at
# expert sizes of 10-400 MB it is < 1% of the transfer).
LINKS: dict[str, LinkProfile] = {
    # PCIe 4.0: 16 GT/s per lane, 128b/130b encoding, x16 -> 31.5 GB/s per direction (PCI-SIG, PCI
    # Express Base Specification 4.0); MoE-Infinity §7.1 rounds it to 32 GB/s. x 0.8 = 25.2 GB/s.
    "pcie4": LinkProfile("pcie4", 31.5, 10.0, "PCI-SIG PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b"),
    # PCIe 5.0: 32 GT/s per lane, 128b/130b, x16 -> 63.0 GB/s per direction (PCI-SIG, PCIe 5.0).
    "pcie5": LinkProfile("pcie5", 63.0, 10.0, "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b"),
    # NVLink-C2C (Grace Hopper): 900 GB/s bidirectional = 450 GB/s per direction (NVIDIA GH200
    # Grace Hopper Superchip data sheet / "NVIDIA Grace Hopper Superchip Architecture" whitepaper).
    "nvlink-c2c": LinkProfile(
        "nvlink-c2c", 450.0, 5.0, "NVIDIA GH200 data sheet: NVLink-C2C 900 GB/s bidir."
    ),
}

GPUS: dict[str, GPUProfile] = {
    # NVIDIA RTX A5000 data sheet: 24 GB GDDR6, 768 GB/s, tensor 222.2 TFLOPS with sparsity ->
    # 111.1 TFLOPS dense FP16/BF16. The GPU of MoE-Infinity's evaluation server (§7.1).
    "a5000": GPUProfile("a5000", 24 * GiB, 111.1e12, 768.0, "NVIDIA RTX A5000 data sheet"),
    # NVIDIA A100 data sheet (80GB SXM): HBM2e 2,039 GB/s, BF16 tensor 312 TFLOPS dense.
    "a100-80gb": GPUProfile("a100-80gb", 80 * GiB, 312e12, 2039.0, "NVIDIA A100 80GB SXM data sheet"),
    # NVIDIA H100 data sheet (SXM5 80GB): HBM3 3.35 TB/s, BF16 tensor 989 TFLOPS dense (1,979 sparse).
    "h100-80gb": GPUProfile("h100-80gb", 80 * GiB, 989e12, 3350.0, "NVIDIA H100 SXM5 data sheet"),
    # NVIDIA GH200 data sheet: the Hopper GPU of the superchip with 96 GB HBM3 at 4 TB/s, same
    # tensor cores as H100 SXM (989 TFLOPS dense BF16).
    "gh200-96gb": GPUProfile("gh200-96gb", 96 * GiB, 989e12, 4000.0, "NVIDIA GH200 data sheet (96 GB HBM3)"),
}

# Per-expert host overhead of a CPU expert (Python dispatch, the activation, the output's copy back):
# 50 us, an assumption; calibration (moeserve.sim.calibrate) measures it.
CPU_EXPERT_OVERHEAD_US = 50.0
# Time per range of a split projection that the pool's threads take in turn (its Python on the GIL:
# the weight view, the op's dispatch, the barrier's bookkeeping; the GIL's handoff): measured on the
# 2-core EPYC host, one expert of negligible compute split into 16 ranges over 8 pool threads against
# 2 ranges over 1: 11.7-11.9 us more per range (2 cores, load average 2.2-2.9).
UNIT_OVERHEAD_US = 12.0

HOSTS: dict[str, HostProfile] = {
    # MoE-Infinity's A5000 testbed (§7.1): an 8-GPU server with 1 TB of DRAM; the paper names no
    # CPU. Assumed: a dual-socket AMD EPYC 7543 (Zen 3 "Milan", the 2021 class of 8-GPU PCIe 4.0
    # servers), 16 x 64 GB DDR4-3200, one socket per NUMA node. AMD EPYC 7543 product page: 32
    # cores / 64 threads, 2.8 GHz base, 8 channels DDR4-3200 = 204.8 GB/s per socket. Zen 3 has
    # two 256-bit FMA pipes and no BF16 arithmetic: 32 FP32 FLOP/cycle x 32 cores x 2.8 GHz.
    "epyc-7543": HostProfile(
        "epyc-7543",
        32,
        64,
        204.8,
        32 * 32 * 2.8e9,
        "fma",
        CPU_EXPERT_OVERHEAD_US,
        UNIT_OVERHEAD_US,
        "AMD EPYC 7543 product page (assumed CPU of MoE-Infinity's 1 TB A5000 server)",
    ),  # fmt: skip
    # NVIDIA DGX A100 user guide: 2 x AMD EPYC 7742. AMD EPYC 7742 product page: 64 cores / 128
    # threads, 2.25 GHz base, 8 x DDR4-3200 = 204.8 GB/s per socket; Zen 2: 32 FP32 FLOP/cycle.
    "epyc-7742": HostProfile(
        "epyc-7742",
        64,
        128,
        204.8,
        64 * 32 * 2.25e9,
        "fma",
        CPU_EXPERT_OVERHEAD_US,
        UNIT_OVERHEAD_US,
        "AMD EPYC 7742 product page; NVIDIA DGX A100 user guide",
    ),  # fmt: skip
    # A typical H100 server socket (NVIDIA DGX H100 user guide: 2 x Xeon Platinum 8480C). Intel
    # ARK, Xeon Platinum 8480+: 56 cores / 112 threads, 2.0 GHz base, 8 channels DDR5-4800 =
    # 307.2 GB/s nominal (~246 GB/s sustained at 0.8). AMX: 1024 BF16 FLOP/cycle/core (Intel
    # AMX overview), x 56 cores x 2.0 GHz = 114.7 TFLOP/s, the data-sheet peak torch's BF16 linear
    # (oneDNN) runs on; sustained at GEMM_EFFICIENCY["amx"].
    "xeon-8480": HostProfile(
        "xeon-8480",
        56,
        112,
        307.2,
        1024 * 56 * 2.0e9,
        "amx",
        CPU_EXPERT_OVERHEAD_US,
        UNIT_OVERHEAD_US,
        "Intel ARK Xeon Platinum 8480+; NVIDIA DGX H100 user guide",
    ),  # fmt: skip
    # NVIDIA GH200 Grace Hopper Superchip data sheet: 72 Arm Neoverse V2 cores, LPDDR5X up to
    # 512 GB/s. NVIDIA Grace CPU Superchip data sheet: 7.1 TFLOPS FP64 peak for 144 cores, so 3.55
    # per 72-core Grace and twice that in FP32 (7.1 TFLOP/s; BF16 matrix peaks are not in it);
    # sustained at GEMM_EFFICIENCY["fma"] (measured on an x86 core: an assumption for Neoverse V2).
    "grace-72": HostProfile(
        "grace-72",
        72,
        72,
        512.0,
        7.1e12,
        "fma",
        CPU_EXPERT_OVERHEAD_US,
        UNIT_OVERHEAD_US,
        "NVIDIA GH200 and Grace CPU Superchip data sheets",
    ),  # fmt: skip
}

# The host each GPU sits in (its socket).
GPU_HOSTS: dict[str, str] = {
    "a5000": "epyc-7543",
    "a100-80gb": "epyc-7742",
    "h100-80gb": "xeon-8480",
    "gh200-96gb": "grace-72",
}

ALIASES: dict[str, str] = {
    "a5000": "a5000+pcie4",  # MoE-Infinity's 8-A5000 server: one PCIe 4.0 x16 link per GPU (§7.1)
    "a100": "a100-80gb+pcie4",
    "h100": "h100-80gb+pcie5",
    "gh200": "gh200-96gb+nvlink-c2c",
}


def hardware_names() -> list[str]:
    """Every accepted ``--hardware`` value (aliases first, then all ``gpu+link`` pairs)."""
    return list(ALIASES) + [f"{g}+{lk}" for g in GPUS for lk in LINKS]


def get_hardware(name: str) -> HardwareProfile:
    """Look up ``name`` (an alias or ``gpu+link``).

    Raises:
        ConfigError: unknown GPU, link or alias (one line naming it and the choices).
    """
    full = ALIASES.get(name, name)
    gpu_name, _, link_name = full.partition("+")
    if gpu_name not in GPUS or link_name not in LINKS:
        raise ConfigError(
            f"--hardware {name!r} is unknown (choose an alias {', '.join(ALIASES)} or GPU+LINK with "
            f"GPU in {', '.join(GPUS)} and LINK in {', '.join(LINKS)})"
        )
    return HardwareProfile(name, GPUS[gpu_name], LINKS[link_name], HOSTS[GPU_HOSTS[gpu_name]])
