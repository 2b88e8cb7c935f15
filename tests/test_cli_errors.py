"""Bad input gives one clear line naming the file/tensor/value, exit code 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.cli import main
from server.runner import MODEL_EXIT, USAGE_EXIT


def run_cli(capsys, *args: str) -> tuple[int, str]:
    rc = main(list(args))
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.fixture()
def ckpt_copy(tiny_qwen3, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, dst)
    return dst


def assert_one_line(rc: int, err: str, *needles: str, code: int = 2) -> None:
    assert rc == code, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeserve: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_folder_without_config(capsys, tmp_path):
    rc, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "x")
    assert_one_line(rc, err, str(tmp_path), "config.json")


def test_unknown_architecture(capsys, ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli(capsys, "generate", "--model", str(ckpt_copy), "--prompt", "x")
    assert_one_line(rc, err, "GPT2LMHeadModel", "config.json")


def test_invalid_config_json(capsys, ckpt_copy):
    (ckpt_copy / "config.json").write_text("{not json")
    rc, err = run_cli(capsys, "generate", "--model", str(ckpt_copy), "--prompt", "x")
    assert_one_line(rc, err, "config.json", "invalid JSON")


def _rewrite(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_expert_tensor(capsys, ckpt_copy):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(ckpt_copy, lambda t: t.pop(name))
    rc, err = run_cli(capsys, "generate", "--model", str(ckpt_copy), "--prompt", "x")
    assert_one_line(rc, err, name)


def test_missing_dense_tensor(capsys, ckpt_copy):
    _rewrite(ckpt_copy, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"))
    rc, err = run_cli(capsys, "generate", "--model", str(ckpt_copy), "--prompt", "x")
    assert_one_line(rc, err, "model.layers.0.self_attn.k_norm.weight")


def test_misshaped_tensor(capsys, ckpt_copy):
    name = "model.layers.0.mlp.experts.0.down_proj.weight"

    def edit(t):
        t[name] = torch.zeros(3, 5)

    _rewrite(ckpt_copy, edit)
    rc, err = run_cli(capsys, "generate", "--model", str(ckpt_copy), "--prompt", "x")
    assert_one_line(rc, err, name, "[3, 5]")


def test_corrupt_safetensors(capsys, ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    rc, err = run_cli(capsys, "generate", "--model", str(ckpt_copy), "--prompt", "x")
    assert_one_line(rc, err, "model.safetensors")


def test_prompt_longer_than_context(capsys, tiny_qwen3):
    rc, err = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_qwen3),
        "--prompt",
        "hello world " * 100,
        "--max-model-len",
        "64",
    )
    assert_one_line(rc, err, "tokens", "64")


def test_bad_flag_value(capsys, tiny_qwen3):
    rc, err = run_cli(
        capsys, "generate", "--model", str(tiny_qwen3), "--prompt", "x", "--buffer-fraction", "1.5"
    )
    assert_one_line(rc, err, "--buffer-fraction", "1.5")


def test_generate_json_end_to_end_subprocess(tiny_qwen3):
    """The installed entry point: JSON output on success, exit 2 and one line on error."""
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeserve",
            "generate",
            "--model",
            str(tiny_qwen3),
            "--prompt",
            "def add",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--buffer-slots",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert len(out["token_ids"]) == 5 and isinstance(out["text"], str)
    assert out["stats"]["expert"]["lookups"] > 0 and out["stats"]["expert"]["demand_bytes"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "moeserve", "generate", "--model", "/nonexistent", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [("--router-lookahead", "-1", "--router-lookahead"), ("--cache-policy", "mru", "--cache-policy")],
)
def test_bad_policy_flags(capsys, tiny_qwen3, flag, value, needle):
    args = ["generate", "--model", str(tiny_qwen3), "--prompt", "x", "--buffer-slots", "4", flag, value]
    rc, err = run_cli(capsys, *args)
    assert_one_line(rc, err, needle, value)


def test_serve_exit_codes(capsys, tmp_path, tiny_qwen3):
    """``serve``: a bad flag or address is 2 (nothing loaded), a model it cannot find or load is 4."""
    rc, err = run_cli(capsys, "serve", "--model", str(tmp_path / "nope"), "--port", "0")
    assert_one_line(rc, err, str(tmp_path / "nope"), "does not exist", code=MODEL_EXIT)
    (tmp_path / "empty").mkdir()
    rc, err = run_cli(capsys, "serve", "--model", str(tmp_path / "empty"), "--port", "0")
    assert_one_line(rc, err, "config.json", code=MODEL_EXIT)
    rc, err = run_cli(capsys, "serve", "--model", str(tiny_qwen3), "--port", "70000")
    assert_one_line(rc, err, "--port", "70000", code=USAGE_EXIT)
    rc, err = run_cli(capsys, "serve", "--model", str(tiny_qwen3), "--buffer-fraction", "2", "--port", "0")
    assert_one_line(rc, err, "--buffer-fraction", code=USAGE_EXIT)
    # 192.0.2.1 (TEST-NET-1) is never an address of this machine
    rc, err = run_cli(
        capsys, "serve", "--model", str(tmp_path / "nope"), "--host", "192.0.2.1", "--port", "0"
    )
    assert_one_line(rc, err, "cannot bind 192.0.2.1:0", "not an address of this machine", code=USAGE_EXIT)
