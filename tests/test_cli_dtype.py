"""``--dtype``: the default ``by-device`` (bf16 on CUDA, fp32 on CPU); ``auto`` (bf16 on CUDA, else the
checkpoint's own ``torch_dtype``, fp32 when unnamed); policy flags limited to the registries."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_runtime.config import RuntimeConfig, cache_policy_names, prefetch_policy_names
from moe_runtime.errors import ConfigError
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


@pytest.mark.parametrize(
    ("device", "config", "want"),
    [
        ("cuda", {"torch_dtype": "float32"}, "bf16"),
        ("cuda:0", {}, "bf16"),
        ("cpu", {"torch_dtype": "bfloat16"}, "fp32"),  # unlike auto: CPU stays fp32
        ("cpu", {}, "fp32"),
    ],
)
def test_default_dtype_is_by_device(tmp_path, device, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["generate", "--prompt", "x", "--model", str(tmp_path), "--device", device]
    args = build_parser().parse_args(argv)
    assert args.dtype == "by-device"
    assert _dtype(args) == want


@pytest.mark.parametrize("flag", ["--cache-policy", "--prefetch-policy"])
def test_unknown_policy_refused_even_with_every_expert_resident(capsys, flag):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "--prompt", "x", "--buffer-fraction", "1", flag, "foo"])
    assert exc.value.code == 2 and f"argument {flag}: invalid choice: 'foo'" in capsys.readouterr().err
    field = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=f"{flag} 'foo' is unknown"):
        RuntimeConfig(buffer_fraction=1.0, **{field: "foo"})


def test_policy_choices_are_the_registries():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    choices = {a.dest: a.choices for a in sub._actions}
    assert choices["cache_policy"] == cache_policy_names()
    assert choices["prefetch_policy"] == prefetch_policy_names()
    assert "eam-reuse" in choices["cache_policy"] and "hot-experts" in choices["prefetch_policy"]
