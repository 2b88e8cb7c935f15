"""Flags shared by every command that builds an engine (generate, serve, bench ...).

Flags map one-to-one onto :class:`moe_runtime.config.RuntimeConfig` fields.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from moe_runtime import hub
from moe_runtime.config import (
    DEFAULT_CACHE_POLICY,
    EXPERT_COMPUTE_MODES,
    LOAD_FORMATS,
    MAX_BLOCK_SIZE,
    RuntimeConfig,
    cache_policy_names,
    prefetch_policy_names,
)
from moe_runtime.errors import CheckpointError, ConfigError
from moe_runtime.hub import ModelSource
from moe_runtime.quant.select import EXPERT_DTYPES
from tracer.eamc import DEFAULT_CAPACITY


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint: a local Hugging Face folder, or a Hub repo id org/name resolved through the "
        "Hugging Face cache (HF_HOME, HF_HUB_CACHE; downloaded when missing unless HF_HUB_OFFLINE=1; "
        "HF_TOKEN for gated repos). A path that exists is always a folder; org/name (one '/', no "
        "leading '.', '/' or '~') that does not exist locally is a repo id "
        "(default: the bundled tiny MoE)",
    )
    parser.add_argument(
        "--revision",
        default=None,
        help="branch, tag or commit of a Hub --model (default: main)",
    )


def add_load_format_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--load-format``: the checkpoint's weights, or random ones from its config alone."""
    parser.add_argument(
        "--load-format",
        default="safetensors",
        choices=list(LOAD_FORMATS),
        help="safetensors: the checkpoint's weights; dummy: read only config.json and draw random "
        "weights in memory, to measure a model's speed without its weights (outputs are noise; "
        "moeserve make-checkpoint --config-only writes such a folder for a real shape)",
    )


def add_compile_decode_arg(parser: argparse.ArgumentParser) -> None:
    """A bench's ``--compile-decode``: CPU decode steps through the compiled forward, as serve runs
    them (``moe_runtime.engine.compiled_decode``), compiled before the rows."""
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="CPU: decode steps through the compiled forward, as `moeserve serve` runs them where every "
        "expert is resident (compiled before the rows; default: eager)",
    )


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("runtime")
    add_load_format_arg(g)
    g.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="compute device: cpu, cuda, cuda:1 (default: cuda when present, else cpu)",
    )
    g.add_argument(
        "--num-devices",
        type=int,
        default=1,
        help="devices experts are spread over by a hash of (layer, expert): on CUDA, --device and the "
        "ones after it; on CPU, emulated",
    )
    g.add_argument(
        "--dtype",
        default=BY_DEVICE,
        choices=[BY_DEVICE, "auto", "bf16", "fp16", "fp32"],
        help=f"weights and activations: {BY_DEVICE} = bf16 on CUDA, fp32 on CPU; auto = bf16 on CUDA, "
        "else the checkpoint's torch_dtype",
    )
    g.add_argument(
        "--expert-dtype",
        default="auto",
        choices=list(EXPERT_DTYPES),
        help="format routed experts are kept and moved in (host store, link, slots): auto = the "
        "checkpoint's (fp8 block-scaled stays fp8; unquantized experts in --dtype); fp8 = e4m3 with "
        "one scale per 128x128 block (smaller for narrow experts); int8 = one scale per output "
        "channel; mxfp4; bf16/fp16/fp32. Quantized experts are dequantized to --dtype where they run",
    )
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--buffer-slots",
        type=int,
        default=None,
        help="expert slots in the device buffer (total; default: the memory plan's)",
    )
    size.add_argument(
        "--buffer-fraction",
        type=float,
        default=None,
        help="buffer size as a share of all experts, (0, 1] (default: the memory plan's on CUDA or with "
        "--device-memory; else 1.0 = all resident)",
    )
    g.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="emulate a host->device link of this bandwidth in GB/s (default: off)",
    )
    g.add_argument("--link-latency-us", type=float, default=0.0, help="emulated per-transfer latency (µs)")
    g.add_argument("--max-batch-size", type=int, default=16, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096, help="tokens per step")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens per sequence, prompt and output (default: the model's context, at most 4096)",
    )
    g.add_argument(
        "--prefetch-depth", type=int, default=None, help="later layers a prefetch plan covers (default: all)"
    )
    g.add_argument(
        "--router-lookahead",
        type=int,
        default=1,
        help="next MoE layers the eam prefetch plan predicts with their routers applied to the current "
        "hidden state, and plans (0 = the paper's EAMC-only plan of every later layer; default: 1)",
    )
    g.add_argument(
        "--eamc-capacity",
        type=int,
        default=DEFAULT_CAPACITY,
        help=f"EAM collection entries for the eam policies (default: {DEFAULT_CAPACITY}; docs/tracer.md)",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="intra-op threads for CPU compute (default: 1; see docs/benchmarks.md)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every decode step eagerly: no CUDA graphs (by default, on CUDA, a decode step replays "
        "one graph when every expert is resident, else one per layer's attention block) and, for "
        "serve on the CPU, no compiled decode step (docs/architecture.md)",
    )
    g.add_argument(
        "--cache-policy",
        default=DEFAULT_CACHE_POLICY,
        choices=cache_policy_names(),
        help="expert cache policy (eam-reuse: evict the expert whose next use is furthest, "
        "with the layers' loop counted; eam: MoE-Infinity's)",
    )
    g.add_argument(
        "--prefetch-policy",
        default="eam",
        choices=prefetch_policy_names(),
        help="expert prefetch policy",
    )
    # hybrid expert execution (moe_runtime.hybrid, docs/hybrid.md)
    h = parser.add_argument_group("hybrid expert execution")
    h.add_argument(
        "--expert-compute",
        default=None,
        choices=list(EXPERT_COMPUTE_MODES),
        help="where an expert missing from the device buffer runs: device = copied over the link, run "
        "on the device; cpu = on host threads from the host store, the buffer a fixed set loaded at "
        "start (llama.cpp --n-cpu-moe); auto = each miss where a measured cost model says it finishes "
        "first (default: auto where experts cross a link, CUDA or --link-gbps; else device)",
    )
    h.add_argument(
        "--cpu-expert-threads",
        type=int,
        default=None,
        help="host threads computing experts (default: the cores not taken by the compute thread's "
        "--cpu-threads and the I/O threads, at least 1)",
    )
    # paged KV cache (moe_runtime.layers.kv_cache, moe_runtime.engine.kv_manager, docs/kv-cache.md)
    kv = parser.add_argument_group("paged KV cache")
    kv.add_argument(
        "--block-size",
        type=int,
        default=16,
        help=f"token positions per KV-cache block, 1..{MAX_BLOCK_SIZE} (default: 16; CUDA decodes read "
        "blocks in place at multiples of 16)",
    )
    pool = kv.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks in the pool (default: the memory plan's on CUDA or with --device-memory; "
        "else the memory of --max-batch-size sequences of --max-model-len tokens); sequences are "
        "admitted while blocks are free and preempted (recomputed later) when they run out",
    )
    pool.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=None,
        help="KV cache in bytes (whole blocks; units allowed: 4GiB, 500MB), instead of --num-kv-blocks",
    )
    kv.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes computed before (vLLM's block hashing; "
        "default: on; --no-enable-prefix-caching turns it off)",
    )
    # memory plan (moe_runtime.memory_split, docs/operations.md "Sizing")
    m = parser.add_argument_group("memory plan")
    m.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the device's memory the plan may take: dense weights, activations, KV cache, "
        "expert slots (default: 0.9)",
    )
    m.add_argument(
        "--device-memory",
        type=byte_size,
        default=None,
        help="bytes standing in for the device's memory (units allowed: 24GiB); on the CPU it turns the "
        "plan on (default: CUDA's own; none on the CPU: every expert resident)",
    )
    m.add_argument(
        "--plan-data",
        action="append",
        default=None,
        metavar="PATH",
        help="a trace file or EAMC file of past traffic: the plan takes its sequence lengths and expert "
        "hit-rate curve from it (repeatable; default: serve's --record-trace and --eamc-path files when "
        "they exist, else the Azure conversation lengths and a Zipf routing)",
    )


def runtime_from_args(
    args: argparse.Namespace, dtype: str | None = None, compile_decode: bool = False
) -> RuntimeConfig:
    """Build (and validate) the runtime settings from parsed flags.

    ``dtype`` replaces ``--dtype`` (by default resolved by :func:`_dtype`, which reads the
    checkpoint's ``config.json`` for ``--dtype auto`` on CPU): a caller that checks the flags
    before the model is resolved passes one so nothing is read or downloaded yet.
    ``compile_decode``: the command compiles CPU decode steps unless ``--enforce-eager`` (serve).
    """
    return RuntimeConfig(
        device=args.device,
        num_devices=args.num_devices,
        dtype=dtype or _dtype(args),
        buffer_slots=args.buffer_slots,
        buffer_fraction=args.buffer_fraction,
        link_gbps=args.link_gbps,
        link_latency_us=args.link_latency_us,
        max_batch_size=args.max_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        cache_policy=args.cache_policy,
        prefetch_policy=args.prefetch_policy,
        cpu_threads=args.cpu_threads,
        prefetch_depth=args.prefetch_depth,
        router_lookahead=args.router_lookahead,
        eamc_capacity=args.eamc_capacity,
        expert_dtype=args.expert_dtype,
        expert_compute=getattr(args, "expert_compute", None),
        cpu_expert_threads=getattr(args, "cpu_expert_threads", None),
        block_size=getattr(args, "block_size", 16),
        num_kv_blocks=getattr(args, "num_kv_blocks", None),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
        device_memory=getattr(args, "device_memory", None),
        kv_cache_memory=getattr(args, "kv_cache_memory", None),
        plan_data=_plan_data(args),
        cuda_graphs=not getattr(args, "enforce_eager", False),
        compile_decode=compile_decode and not getattr(args, "enforce_eager", False),
        load_format=getattr(args, "load_format", "safetensors"),
    )


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def byte_size(text: str) -> int:
    """``--device-memory``/``--kv-cache-memory``: bytes, with an optional unit (``24GiB``,
    ``500MB``, ``80G``: binary for ``KiB``..``TiB``, decimal for ``K``/``KB``..``T``/``TB``).

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kmgtKMGT]?)(i?)[bB]?\s*", text)
    if not m or (m.group(3) and not m.group(2)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 24GiB, 500MB, 1000000)")
    unit = m.group(2).lower()
    scale = 1 << (10 * "kmgt".index(unit) + 10) if m.group(3) else _UNITS[unit]
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1 byte")
    return value


def _plan_data(args: argparse.Namespace) -> tuple[str, ...]:
    """``--plan-data`` files, else serve's own ``--record-trace`` and ``--eamc-path`` files where
    they exist and hold something (an ``--eamc-on-corrupt reset`` EAMC is left out: it may not read)."""
    given = getattr(args, "plan_data", None)
    if given:
        return tuple(given)
    found = []
    trace, eamc = getattr(args, "record_trace", None), getattr(args, "eamc_path", None)
    if trace is not None and Path(trace).is_file() and Path(trace).stat().st_size > 0:
        found.append(str(trace))
    if eamc is not None and Path(eamc).is_file() and getattr(args, "eamc_on_corrupt", "fail") == "fail":
        found.append(str(eamc))
    return tuple(found)


#: The ``--dtype`` default: bf16 on CUDA (fp32 there wastes half the memory and bandwidth),
#: fp32 on CPU. Not ``auto``: on CPU, fp32 is what the bundled model's results and the oracle tests
#: against transformers use, whatever dtype a checkpoint was saved in.
BY_DEVICE = "by-device"

_CHECKPOINT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtype_needs_checkpoint(args: argparse.Namespace) -> bool:
    """Whether ``--dtype`` is read from the checkpoint's ``config.json`` (``auto`` off CUDA)."""
    return args.dtype == "auto" and not str(args.device).startswith("cuda")


def _dtype(args: argparse.Namespace) -> str:
    """``--dtype``, resolved: ``by-device`` = bf16 on CUDA, fp32 elsewhere; ``auto`` = bf16 on
    CUDA, else the checkpoint's ``torch_dtype`` (``dtype`` in newer configs) from its
    ``config.json``, fp32 when it names none."""
    if args.dtype not in ("auto", BY_DEVICE):
        return args.dtype
    if str(args.device).startswith("cuda"):
        return "bf16"
    if args.dtype == BY_DEVICE:
        return "fp32"
    path = resolve_model(args) / "config.json" if hasattr(args, "model") else None
    try:
        config = json.loads(path.read_text()) if path is not None else {}
    except (OSError, json.JSONDecodeError):
        config = {}  # the loader reports a missing or broken config.json with its own message
    return _CHECKPOINT_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), "fp32")


def resolve_model(args: argparse.Namespace) -> Path:
    """The checkpoint folder of ``--model`` (and ``--revision``): see :func:`model_source`."""
    return model_source(args).path


def model_source(args: argparse.Namespace) -> ModelSource:
    """``--model`` resolved (:func:`moe_runtime.hub.resolve`: a local folder, or a Hub repo id
    through the Hugging Face cache), or the bundled default checkpoint. Resolved once per parsed
    ``args``; later calls return the same folder.

    Raises:
        CheckpointError: no ``--model`` and the bundled model is missing from this install; a
            ``--model`` that is neither a folder nor a repo id; a repo that cannot be resolved
            (:class:`moe_runtime.hub.HubError`).
        ConfigError: ``--revision`` with a local folder.
    """
    model, revision = args.model, getattr(args, "revision", None)
    cached = getattr(args, "_model_source", None)
    if cached is not None and cached[:2] == (model, revision):
        return cached[2]
    if model is not None:
        source = hub.resolve(model, revision)
    elif revision is not None:
        raise ConfigError("--revision needs a Hugging Face repo id as --model")
    else:
        try:
            from moe_runtime.assets import default_model_dir
        except ImportError:
            raise CheckpointError("no --model given and the bundled default model is not installed") from None
        path = default_model_dir()
        source = ModelSource(path, hub.served_name(path))
    args._model_source = (model, revision, source)
    return source
