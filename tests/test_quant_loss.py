"""Held-out loss per expert format (moeserve/train/quant_loss.py, ``moeserve bench quant-loss``):
the model evaluated carries exactly the runtime's stored experts."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from moe_runtime.quant.fp8 import Fp8BlockCodec
from moeserve.train.quant_loss import measure, model_with_served_experts, render
from moeserve.train.trainer import evaluate


def test_served_experts_are_the_codec_round_trip(tiny_qwen3):
    model, name, nbytes = model_with_served_experts(tiny_qwen3, "fp8")
    assert name == "fp8 e4m3 block [32, 32]" and nbytes == 3 * (48 * 64 + 16)
    codec = Fp8BlockCodec((32, 32))
    w = load_file(str(tiny_qwen3 / "model.safetensors"))["model.layers.1.mlp.experts.3.down_proj.weight"]
    want = codec.dequantize(codec.quantize(w), *w.shape, torch.float32)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[3], want)


def test_measure_rows_and_rise(tiny_qwen3):
    windows = {"a": torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))}
    result = measure(tiny_qwen3, windows, ("auto", "int8"))
    auto, int8 = result["rows"]
    plain, _, _ = model_with_served_experts(tiny_qwen3, "auto")
    assert auto["loss"] == evaluate(plain, windows) and auto["rise_percent"] == 0.0
    assert int8["rise_percent"] == 100 * (int8["mean"] - auto["mean"]) / auto["mean"] != 0.0
    assert "| int8 | int8 per output channel |" in render(result)


def test_bench_quant_loss_prints_rows_and_settings(tiny_qwen3, monkeypatch, capsys):
    import moeserve.train.quant_loss as ql
    from moeserve.cli import main

    windows = {"a": torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))}
    monkeypatch.setattr(ql, "heldout_windows", lambda model, data_dir: windows)
    argv = ["bench", "quant-loss", "--model", str(tiny_qwen3), "--formats", "auto,int8"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["expert_dtype"] for r in out["rows"]] == ["auto", "int8"]
    assert out["rows"][1]["rise_percent"] != 0.0 and out["windows"] == {"a": [2, 17]}
    st = out["settings"]
    assert st["formats"] == ["auto", "int8"] and "deterministic" in st["repeats"] and "fp32" in st["compute"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| int8 | int8 per output channel |" in text and "settings: model=" in text
