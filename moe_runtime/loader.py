"""Load a local Hugging Face MoE checkpoint: dense weights to the device, experts to the host store.

Reads ``config.json``, ``generation_config.json`` (optional), one or many ``*.safetensors``
(``model.safetensors.index.json`` when sharded) and the tokenizer files. Tensors are read one at a
time through ``safe_open`` (memory-mapped), so the model is never materialised twice: a dense tensor
goes straight to the compute device, an expert matrix straight into its packed slot of the
:class:`~moe_runtime.store.HostExpertStore`.

Every failure is a :class:`~moe_runtime.errors.CheckpointError` or
:class:`~moe_runtime.errors.ConfigError` whose message names the file, tensor or field.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_runtime.config import ModelConfig, RuntimeConfig
from moe_runtime.dummy_weights import random_weights
from moe_runtime.errors import CheckpointError, ConfigError, InsufficientMemoryError
from moe_runtime.memory_plan import check_memory, human_bytes, plan_memory
from moe_runtime.memory_split import MemorySplit, measure_devices, resolve_split
from moe_runtime.models import ConfigFields, ExpertTensor, Family, family_for
from moe_runtime.models.base import expected_dense_shapes
from moe_runtime.quant import expert_layout, parse_quantization
from moe_runtime.quant.checkpoint import DEFAULT_SUFFIXES, QuantPairs
from moe_runtime.quant.select import checkpoint_codec
from moe_runtime.store import HostExpertStore
from moe_runtime.tensor_checks import check_finite, check_weight_dtype
from moe_runtime.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """Everything a runtime needs from a checkpoint folder."""

    path: Path
    family: Family
    config: ModelConfig
    dense: dict[str, torch.Tensor]
    store: HostExpertStore
    tokenizer: Tokenizer | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    load_seconds: float = 0.0
    # the memory plan made for ``runtime`` before the load, and the CUDA devices' (free, total)
    # bytes measured then (moe_runtime.memory_split): an engine on other settings plans again
    runtime: RuntimeConfig | None = None
    memory_split: MemorySplit | None = None
    device_memory: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def dense_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dense.values())

    @property
    def eos_token_ids(self) -> list[int]:
        ids = list(self.config.eos_token_ids)
        gen = self.generation_config.get("eos_token_id")
        for tid in gen if isinstance(gen, list) else [gen]:
            if isinstance(tid, int) and tid not in ids and 0 <= tid < self.config.vocab_size:
                ids.append(tid)
        for tid in self.tokenizer.eos_token_ids if self.tokenizer else []:
            if tid not in ids:
                ids.append(tid)
        return ids


#: Largest ``config.json`` / index / generation config read (real ones are a few KiB to 1 MiB).
MAX_JSON_BYTES = 64 << 20


def _read_json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, more than the {MAX_JSON_BYTES} read")
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def model_root(model_dir: Path) -> Path:
    """The folder every file of a checkpoint must resolve into: the model folder itself, or for a
    Hugging Face cache snapshot (``models--org--name/snapshots/<rev>``, whose files are symlinks
    to ``../../blobs/<sha>``) the ``models--org--name`` folder."""
    real = model_dir.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def check_inside(file: Path, root: Path, source: str) -> Path:
    """``file`` resolved (symlinks followed), refused when it leaves ``root``.

    Raises:
        CheckpointError: ``"<source> resolves to <path>, outside the model folder <root>"``.
    """
    real = file.resolve()
    if not real.is_relative_to(root):
        raise CheckpointError(f"{source} resolves to {real}, outside the model folder {root}")
    return real


def read_model_config(model_dir: str | Path) -> tuple[Family, ModelConfig, dict[str, Any]]:
    """Parse ``config.json`` into the family and :class:`ModelConfig` (no weights read).

    Raises:
        CheckpointError: no folder, no or unreadable ``config.json``.
        ConfigError: ``"<path>/config.json: <field> must be ..., got <value>"`` for the first field
            that is missing, mistyped, out of range (:data:`moe_runtime.config.MODEL_LIMITS`) or
            inconsistent with another.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: model folder does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json in the model folder")
    check_inside(cfg_path, model_root(path), str(cfg_path))
    raw = _read_json(cfg_path)
    try:
        family = family_for(raw)
        cfg = family.parse_config(ConfigFields(raw))
        cfg.quant_method, cfg.weight_block_size = parse_quantization(raw)
        return family, cfg, raw
    except ConfigError as exc:
        raise ConfigError(f"{cfg_path}: {exc}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """Weight files in load order, from the index when the checkpoint is sharded.

    Raises:
        CheckpointError: no weight file, an index without a ``weight_map`` object of strings, a
            listed file that does not exist, or a file (index entry or symlink) that resolves
            outside the model folder (see :func:`model_root`).
    """
    root = model_root(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        check_inside(index, root, str(index))
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
        files = []
        for name in sorted(set(weight_map.values())):
            f = model_dir / name
            check_inside(f, root, f"{index}: weight_map entry {name!r}")
            if not f.is_file():
                raise CheckpointError(f"{index}: lists {name}, which does not exist")
            files.append(f)
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files")
    for f in files:
        check_inside(f, root, str(f))
    return files


def _progress(total: int, label: str):
    """A rich progress bar on a terminal, nothing otherwise."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tensors"),
        TimeRemainingColumn(),
        transient=True,
    )
    prog.start()
    prog.add_task(label, total=total)
    return prog


def load_checkpoint(
    model_dir: str | Path, runtime: RuntimeConfig | None = None, load_tokenizer: bool = True
) -> LoadedModel:
    """Load a checkpoint folder for serving.

    Args:
        model_dir: local Hugging Face checkpoint folder.
        runtime: device, dtype and pinning; defaults to ``RuntimeConfig()`` (CPU, fp32).
        load_tokenizer: read ``tokenizer.json`` when present.

    Checks, in order, each before the next step's work: ``config.json`` fields (typed and
    range-checked), every file inside the model folder, the memory plan against available host
    and device memory (:mod:`moe_runtime.memory_plan`), then per tensor as it is read: a float
    dtype, the shape the config implies, finite values (:mod:`moe_runtime.tensor_checks`).

    Raises:
        CheckpointError: missing folder/files, a file outside the model folder, corrupt
            safetensors, a missing, misshaped, non-float or non-finite tensor (named).
        ConfigError: unsupported architecture, or a config field missing, mistyped or out of range.
        InsufficientMemoryError: the planned memory does not fit (needed vs available bytes), or
            the device budget cannot hold the dense part (:mod:`moe_runtime.memory_split`).
    """
    t0 = time.perf_counter()
    runtime = runtime or RuntimeConfig()
    path = Path(model_dir)
    family, cfg, _ = read_model_config(path)
    dtype, device = runtime.torch_dtype, runtime.torch_device
    if runtime.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {runtime.device}: CUDA is not available on this machine")
    dummy = runtime.load_format == "dummy"  # config.json only: random weights (dummy_weights)
    files = [] if dummy else safetensors_files(path)
    measured = measure_devices(runtime)  # before anything of ours is on the device
    split = resolve_split(cfg, runtime, measured, str(path))
    plan = plan_memory(cfg, split.runtime)
    check_memory(plan, str(path))
    pin = runtime.pin_memory if runtime.pin_memory is not None else device.type == "cuda"
    moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    shape = (cfg.num_moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    layout = expert_layout(cfg, runtime)
    codec = checkpoint_codec(cfg.quant_method, cfg.weight_block_size)
    pairs = None
    if codec is not None and not dummy:
        suffixes = family.suffixes_for(cfg.quant_method) or DEFAULT_SUFFIXES[cfg.quant_method]
        pairs = QuantPairs(codec, suffixes)
    # experts already in the format they are kept in are copied as stored, not dequantized
    passthrough = codec is not None and layout is not None and layout.describe() == codec.describe()
    try:
        store = HostExpertStore(*shape, dtype, pin_memory=pin, layout=layout)
    except (RuntimeError, MemoryError) as exc:  # memory taken by others since the plan was checked
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InsufficientMemoryError(
            f"{path}: cannot allocate the {human_bytes(plan.expert_store)} expert store ({reason})"
        ) from None
    want = expected_dense_shapes(cfg)
    dense: dict[str, torch.Tensor] = random_weights(family, cfg, want, store, runtime) if dummy else {}
    from safetensors import safe_open

    handles = []
    for f in files:
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as exc:  # safetensors raises SafetensorError / OSError
            raise CheckpointError(f"{f}: not a readable safetensors file ({exc})") from None
    total = sum(len(h.keys()) for _, h in handles)
    bar = _progress(total, f"loading {path.name}")
    try:
        for f, handle in handles:
            for name in handle.keys():
                piece = pairs.component(name, _stored_dtype(handle, name)) if pairs is not None else None
                kind = family.classify(piece[0] if piece else name)
                if kind is None or family.ignores(name, cfg):
                    continue
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"{f}: tensor {name} cannot be read ({exc})") from None
                src = f"{f.name}: tensor {name}"
                if piece is not None:  # a quantized weight or its scales: wait for the rest
                    parts = pairs.add(*piece, tensor)
                    if parts is None:
                        continue
                    src = f"{f.name}: tensor {piece[0]}"
                    if isinstance(kind, ExpertTensor) and (kind.expert is not None or codec.row_scaled):
                        _store_quantized(store, family, kind, moe_index, parts, pairs, src, passthrough)
                        continue
                    width = (
                        (store.intermediate_size if kind.part == "down" else store.hidden_size)
                        if isinstance(kind, ExpertTensor)
                        else want.get(kind, (None,))[-1]
                    )
                    # dense layers (and fused block-scaled experts): dequantized at load
                    tensor = pairs.dequantize(parts, src, width)
                check_weight_dtype(tensor, src)
                if isinstance(kind, ExpertTensor):
                    _store_expert(store, family, kind, moe_index, tensor, src)
                else:
                    if kind not in want:
                        raise CheckpointError(f"{src} is not expected for this config")
                    if tuple(tensor.shape) != want[kind]:
                        raise CheckpointError(
                            f"{src}: expected shape {list(want[kind])}, found {list(tensor.shape)}"
                        )
                    tensor = family.dense_tensor(kind, tensor)
                    try:
                        dense[kind] = tensor.to(device=device, dtype=family.dense_dtype(kind, dtype))
                    except torch.OutOfMemoryError:  # taken by another process since the plan was checked
                        raise InsufficientMemoryError(f"{src}: {device} ran out of memory") from None
                    check_finite(dense[kind], tensor, src)
                if bar is not None:
                    bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    if pairs is not None:
        pairs.check_complete()  # a weight without its scales (or scales without their weight)
    for name in want:
        if name not in dense:
            raise CheckpointError(f"{path}: missing tensor {family.hf_name(name)}")
    store.check_complete(lambda li, e, part: family.expert_name(cfg.moe_layers[li], e, part))
    root = model_root(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (path / name).exists():
            check_inside(path / name, root, str(path / name))
    tokenizer = Tokenizer(path) if load_tokenizer and (path / "tokenizer.json").exists() else None
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    took = time.perf_counter() - t0
    return LoadedModel(path, family, cfg, dense, store, tokenizer, gen, took, runtime, split, measured)


def _stored_dtype(handle: Any, name: str) -> torch.dtype | None:
    """The dtype of a tensor in an open safetensors file, without reading it (None if unknown)."""
    from safetensors.torch import _getdtype

    try:
        return _getdtype(handle.get_slice(name).get_dtype())
    except Exception:  # an unknown dtype string: the read below reports the tensor
        return None


def _store_quantized(
    store: HostExpertStore,
    family: Family,
    kind: ExpertTensor,
    moe_index: dict[int, int],
    parts: dict[str, torch.Tensor],
    pairs: QuantPairs,
    src: str,
    passthrough: bool,
) -> None:
    """A quantized expert matrix (its components by name), one expert's or fused ``[E, out, ...]``
    (split per part on the stored rows, :meth:`Family.fused_quantized_experts`). ``passthrough``
    (the store keeps the checkpoint's format): copied as stored; otherwise dequantized (padding
    cropped) and written in the store's format. Either way checked finite as it will be served
    (for MXFP4 from the scales alone when they bound every value, :meth:`Codec.surely_finite`)."""
    if kind.layer not in moe_index:
        raise CheckpointError(f"{src}: layer {kind.layer} is not an MoE layer in config.json")
    _, _, lead = pairs.check_stored(parts, src)
    layer = moe_index[kind.layer]
    if kind.expert is None:
        if lead != (store.num_experts,):
            raise CheckpointError(
                f"{src}: expected {store.num_experts} stacked experts, found leading dims {list(lead)}"
            )
        stacks = family.fused_quantized_experts(kind.part, parts, store.intermediate_size)
        matrices = [
            (e, part, {c: t[e] for c, t in comps.items()})
            for e in range(store.num_experts)
            for part, comps in stacks.items()
        ]
    else:
        matrices = [(kind.expert, kind.part, parts)]
    for expert, part, comps in matrices:
        width = store.intermediate_size if part == "down" else store.hidden_size
        if passthrough:
            store.write_stored(layer, expert, part, comps, src)
            if not pairs.codec.surely_finite(comps, store.compute_dtype):
                served = store.dequant(layer, expert, part)
                check_finite(served, pairs.dequantize(comps, src, width), src)
        else:
            tensor = pairs.dequantize(comps, src, width)
            check_finite(store.write(layer, expert, part, tensor, src), tensor, src)


def _store_expert(
    store: HostExpertStore,
    family: Family,
    kind: ExpertTensor,
    moe_index: dict[int, int],
    tensor: torch.Tensor,
    src: str,
) -> None:
    if kind.layer not in moe_index:
        raise CheckpointError(f"{src}: layer {kind.layer} is not an MoE layer in config.json")
    layer = moe_index[kind.layer]
    if kind.expert is not None:
        check_finite(store.write(layer, kind.expert, kind.part, tensor, src), tensor, src)
        return
    # Fused [E, ...] gate_up / down tensors, in the family's layout (Family.fused_experts).
    if tensor.dim() != 3 or tensor.shape[0] != store.num_experts:
        raise CheckpointError(
            f"{src}: expected {store.num_experts} stacked experts, found shape {list(tensor.shape)}"
        )
    stacks = family.fused_experts(kind.part, tensor, store.intermediate_size)
    for e in range(store.num_experts):
        for part, stack in stacks.items():
            stored = stack[e]
            check_finite(store.write(layer, e, part, stored, src), stored, src)
