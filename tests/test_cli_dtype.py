"""``--dtype auto``: bf16 on CUDA, else the checkpoint's own ``torch_dtype`` (fp32 when unnamed)."""

from __future__ import annotations

import argparse
import json

import pytest

from moeserve.cli import build_parser
from moeserve.commands.common import _dtype, runtime_from_args


@pytest.mark.parametrize(
    ("device", "config", "want"),
    [
        ("cuda", {"torch_dtype": "float32"}, "bf16"),
        ("cuda:1", {}, "bf16"),
        ("cpu", {"torch_dtype": "bfloat16"}, "bf16"),
        ("cpu", {"dtype": "float16"}, "fp16"),
        ("cpu", {}, "fp32"),
    ],
)
def test_auto_dtype(tmp_path, device, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--model", str(tmp_path), "--dtype", "auto", "--device", device]
    )
    assert args.dtype == "auto"
    if device.startswith("cuda"):  # RuntimeConfig may check CUDA is present: resolve only
        assert _dtype(args) == want
    else:
        assert runtime_from_args(args).dtype == want


def test_explicit_dtype_is_kept(tmp_path):
    args = argparse.Namespace(dtype="fp16", device="cpu", model=tmp_path)
    assert _dtype(args) == "fp16"
