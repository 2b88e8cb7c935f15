"""Bad quantized checkpoints and flags: one line naming the field or tensor, exit status 2."""

from __future__ import annotations

import json

import pytest
from quant_models import write_fp8_checkpoint
from safetensors.torch import load_file, save_file
from test_cli_errors import assert_one_line, run_cli

from moe_runtime.quant.fp8 import Fp8BlockCodec


@pytest.fixture()
def fp8_ckpt(tiny_qwen3, tmp_path):
    write_fp8_checkpoint(tiny_qwen3, tmp_path / "fp8", Fp8BlockCodec((32, 32)), tmp_path / "deq")
    return tmp_path / "fp8"


def _edit_config(path, **quant):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(quant)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path, name):
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


def _generate(capsys, path, *flags):
    return run_cli(capsys, "generate", "--model", str(path), "--prompt", "x", "--max-tokens", "2", *flags)


def test_fp8_checkpoint_generates(capsys, fp8_ckpt):
    rc, _ = _generate(capsys, fp8_ckpt)
    assert rc == 0


def test_unsupported_quant_method(capsys, fp8_ckpt):
    _edit_config(fp8_ckpt, quant_method="awq")
    rc, err = _generate(capsys, fp8_ckpt)
    assert_one_line(rc, err, "config.json", "quantization_config.quant_method 'awq' is not supported")


def test_per_tensor_fp8_is_refused(capsys, fp8_ckpt):
    _edit_config(fp8_ckpt, weight_block_size=None)
    rc, err = _generate(capsys, fp8_ckpt)
    assert_one_line(rc, err, "config.json", "quantization_config.weight_block_size")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.experts.5.up_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
    ],
    ids=["expert", "dense"],
)
def test_missing_scale_tensor(capsys, fp8_ckpt, name):
    _drop_tensor(fp8_ckpt, name)
    rc, err = _generate(capsys, fp8_ckpt)
    assert_one_line(rc, err, f"missing tensor {name}")


def test_scale_of_the_wrong_shape(capsys, fp8_ckpt):
    name = "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"
    tensors = load_file(str(fp8_ckpt / "model.safetensors"))
    tensors[name] = tensors[name][:1].contiguous()
    save_file(tensors, str(fp8_ckpt / "model.safetensors"))
    rc, err = _generate(capsys, fp8_ckpt)
    assert_one_line(rc, err, "model.layers.0.mlp.experts.2.down_proj.weight", "weight_scale_inv", "[2, 2]")


def test_fp8_weight_without_quantization_config(capsys, fp8_ckpt):
    cfg = json.loads((fp8_ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8_ckpt / "config.json").write_text(json.dumps(cfg))
    rc, err = _generate(capsys, fp8_ckpt)
    assert_one_line(rc, err, "has dtype float8_e4m3fn")


def test_bad_expert_dtype_flag(capsys, tiny_qwen3):
    rc, err = _generate(capsys, tiny_qwen3, "--expert-dtype", "int4")
    assert_one_line(rc, err, "--expert-dtype")
