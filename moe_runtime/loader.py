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
from moe_runtime.errors import CheckpointError
from moe_runtime.models import ExpertTensor, Family, family_for
from moe_runtime.store import HostExpertStore
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_model_config(model_dir: str | Path) -> tuple[Family, ModelConfig, dict[str, Any]]:
    """Parse ``config.json`` into the family and :class:`ModelConfig` (no weights read)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: model folder does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json in the model folder")
    raw = _read_json(cfg_path)
    family = family_for(raw, source=str(cfg_path))
    return family, family.parse_config(raw), raw


def safetensors_files(model_dir: Path) -> list[Path]:
    """Weight files in load order, from the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files")
    return files


def expected_dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical dense tensor name -> shape, for the checkpoint's config."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "final_norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    moe = set(cfg.moe_layers)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attn_norm": (h,),
                p + "mlp_norm": (h,),
                p + "q": (q_out, h),
                p + "k": (kv_out, h),
                p + "v": (kv_out, h),
                p + "o": (h, q_out),
            }
        )
        if cfg.attention_bias:
            shapes.update({p + "q_bias": (q_out,), p + "k_bias": (kv_out,), p + "v_bias": (kv_out,)})
        if cfg.qk_norm == "head":
            shapes.update({p + "q_norm": (d,), p + "k_norm": (d,)})
        elif cfg.qk_norm == "full":
            shapes.update({p + "q_norm": (q_out,), p + "k_norm": (kv_out,)})
        if i in moe:
            shapes[p + "router"] = (cfg.num_experts, h)
            si = cfg.shared_expert_intermediate_size
            if si:
                shapes.update(
                    {
                        p + "shared_gate_proj": (si, h),
                        p + "shared_up": (si, h),
                        p + "shared_down": (h, si),
                        p + "shared_gate": (1, h),
                    }
                )
        else:
            di = cfg.dense_intermediate_size
            shapes.update({p + "mlp_gate": (di, h), p + "mlp_up": (di, h), p + "mlp_down": (h, di)})
    return shapes


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

    Raises:
        CheckpointError: missing folder/files, corrupt safetensors, missing or misshaped tensor.
        ConfigError: unsupported architecture or config field.
    """
    t0 = time.perf_counter()
    runtime = runtime or RuntimeConfig()
    path = Path(model_dir)
    family, cfg, _ = read_model_config(path)
    dtype, device = runtime.torch_dtype, torch.device(runtime.device)
    if runtime.device.startswith("cuda") and not torch.cuda.is_available():
        from moe_runtime.errors import ConfigError

        raise ConfigError(f"--device {runtime.device}: CUDA is not available on this machine")
    pin = runtime.pin_memory if runtime.pin_memory is not None else torch.cuda.is_available()
    moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    store = HostExpertStore(
        cfg.num_moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, pin_memory=pin
    )
    want = expected_dense_shapes(cfg)
    dense: dict[str, torch.Tensor] = {}
    files = safetensors_files(path)
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
                kind = family.classify(name)
                if kind is None:
                    continue
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"{f}: tensor {name} cannot be read ({exc})") from None
                src = f"{f.name}: tensor {name}"
                if isinstance(kind, ExpertTensor):
                    _store_expert(store, kind, moe_index, tensor, src)
                else:
                    if kind not in want:
                        raise CheckpointError(f"{src} is not expected for this config")
                    if tuple(tensor.shape) != want[kind]:
                        raise CheckpointError(
                            f"{src}: expected shape {list(want[kind])}, found {list(tensor.shape)}"
                        )
                    dense[kind] = tensor.to(device=device, dtype=dtype)
                if bar is not None:
                    bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    for name in want:
        if name not in dense:
            raise CheckpointError(f"{path}: missing tensor {family.hf_name(name)}")
    parts = dict((v, k) for k, v in family.expert_parts)
    store.check_complete(
        lambda li, e, part: (
            f"model.layers.{cfg.moe_layers[li]}.{family.moe_prefix}.experts.{e}.{parts[part]}.weight"
        )
    )
    tokenizer = Tokenizer(path) if load_tokenizer and (path / "tokenizer.json").exists() else None
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    return LoadedModel(path, family, cfg, dense, store, tokenizer, gen, time.perf_counter() - t0)


def _store_expert(
    store: HostExpertStore, kind: ExpertTensor, moe_index: dict[int, int], tensor: torch.Tensor, src: str
) -> None:
    if kind.layer not in moe_index:
        raise CheckpointError(f"{src}: layer {kind.layer} is not an MoE layer in config.json")
    layer = moe_index[kind.layer]
    if kind.expert is not None:
        store.write(layer, kind.expert, kind.part, tensor, src)
        return
    # Fused [E, 2I, H] gate_up / [E, H, I] down tensors (transformers>=5 in-memory layout).
    if tensor.dim() != 3 or tensor.shape[0] != store.num_experts:
        raise CheckpointError(
            f"{src}: expected {store.num_experts} stacked experts, found shape {list(tensor.shape)}"
        )
    i = store.intermediate_size
    for e in range(store.num_experts):
        if kind.part == "gate_up":
            store.write(layer, e, "gate", tensor[e, :i], src)
            store.write(layer, e, "up", tensor[e, i:], src)
        else:
            store.write(layer, e, "down", tensor[e], src)
