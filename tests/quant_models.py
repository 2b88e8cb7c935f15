"""Quantized variants of the tiny test checkpoints, written in the on-disk formats, and their
float references (the same weights dequantized) for transformers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_runtime.quant.codec import Codec

#: expert matrices of every tiny family (Qwen/OLMoE ``mlp.experts.{e}.*_proj``, Mixtral ``w1/w2/w3``)
EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
#: dense projections a DeepSeek-V3-style FP8 checkpoint stores in FP8 (not norms, embeddings,
#: LM head or router)
DENSE_LINEAR = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$")


def _copy_without_weights(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)


def write_fp8_checkpoint(src: Path, dst: Path, codec: Codec, reference: Path) -> dict[str, torch.Tensor]:
    """``dst``: ``src`` with every expert matrix and attention projection stored as
    ``weight`` float8_e4m3fn + ``weight_scale_inv`` float32 and a ``quantization_config`` (fp8,
    ``weight_block_size`` of ``codec``). ``reference``: ``src`` with those weights dequantized
    (float32, no quantization_config), for transformers. Returns the fp8 checkpoint's tensors."""
    tensors = load_file(str(src / "model.safetensors"))
    out, ref = {}, {}
    for name, t in tensors.items():
        if EXPERT.search(name) or DENSE_LINEAR.search(name):
            parts = codec.quantize(t)
            out[name], out[name + "_scale_inv"] = parts["weight"], parts["weight_scale_inv"]
            ref[name] = codec.dequantize(parts, *t.shape, torch.float32)
        else:
            out[name] = ref[name] = t
    for folder, weights in ((dst, out), (reference, ref)):
        _copy_without_weights(src, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(codec.block),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def write_round_trip_reference(src: Path, dst: Path, codec: Codec) -> None:
    """``dst``: ``src`` with every expert matrix replaced by ``codec``'s quantize-dequantize round
    trip (float32): what the runtime serves with ``--expert-dtype <codec>``."""
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if EXPERT.search(name):
            tensors[name] = codec.dequantize(codec.quantize(t), *t.shape, torch.float32).contiguous()
    _copy_without_weights(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def write_mxfp4_checkpoint(src: Path, dst: Path, reference: Path) -> None:
    """``dst``: a tiny Qwen3-MoE/OLMoE ``src`` whose experts are stored as gpt-oss stores its
    MXFP4 experts: per layer fused ``mlp.experts.gate_up_proj_blocks`` ``[E, 2I, G, 16]`` /
    ``_scales`` ``[E, 2I, G]`` (gate rows, then up rows: transformers' fused layout) and
    ``down_proj_blocks`` / ``_scales``, with ``quantization_config`` ``mxfp4``. ``reference``:
    ``src`` with the experts dequantized (float32), for transformers."""
    from moe_runtime.quant.mxfp4 import Mxfp4Codec

    codec = Mxfp4Codec()
    tensors = load_file(str(src / "model.safetensors"))
    out, ref, fused = {}, {}, {}
    for name, t in tensors.items():
        m = re.search(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            out[name] = ref[name] = t
            continue
        parts = codec.quantize(t)
        ref[name] = codec.dequantize(parts, *t.shape, torch.float32).contiguous()
        fused.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = parts
    for prefix, experts in fused.items():
        order = sorted(experts)
        for fused_name, pieces in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            for comp in ("blocks", "scales"):
                per_expert = [torch.cat([experts[e][p][comp] for p in pieces]) for e in order]
                out[f"{prefix}.{fused_name}_{comp}"] = torch.stack(per_expert)
    for folder, weights in ((dst, out), (reference, ref)):
        _copy_without_weights(src, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))


#: gpt-oss's fused expert tensors, stored ``[E, in, out]`` unquantized
GPT_OSS_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
#: gpt-oss-20b's ``quantization_config`` (the modules left unquantized)
GPT_OSS_MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def write_gpt_oss_mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``dst``: a tiny gpt-oss ``src`` stored as the Hub's gpt-oss checkpoints are: each
    ``mlp.experts.{gate_up,down}_proj [E, in, out]`` becomes ``*_blocks`` uint8 ``[E, out, in/32,
    16]`` and ``*_scales`` uint8 ``[E, out, in/32]`` (the repo's MXFP4 codec per expert, on the
    transposed ``[out, in]`` matrix, so gate_up's rows stay interleaved: gate even, up odd), every
    other tensor as it was, and ``quantization_config`` :data:`GPT_OSS_MXFP4`. ``in`` must be a
    multiple of 32 (transformers does not crop padding). Returns the written tensors."""
    from moe_runtime.quant.mxfp4 import Mxfp4Codec

    codec = Mxfp4Codec()
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if GPT_OSS_EXPERTS.search(name) is None:
            out[name] = t
            continue
        parts = [codec.quantize(w.T) for w in t]
        for comp in ("blocks", "scales"):
            out[f"{name}_{comp}"] = torch.stack([p[comp] for p in parts])
    _copy_without_weights(src, dst)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = GPT_OSS_MXFP4
    (dst / "config.json").write_text(json.dumps(cfg))
    return out
