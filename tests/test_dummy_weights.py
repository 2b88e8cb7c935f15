"""``--load-format dummy`` (``moe_runtime.dummy_weights``): a model from its ``config.json`` alone,
random weights drawn at load, as ``moeserve make-checkpoint`` draws them; and ``make-checkpoint
--config-only``, the folder it reads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.dummy_weights import ROUTER_LOGIT_STD, dense_init
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.errors import CheckpointError, ConfigError
from moe_runtime.loader import load_checkpoint
from moeserve.cli import main

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _tokens(runtime: RuntimeConfig, model=None) -> list[list[int]]:
    with LLMEngine.from_pretrained(model or default_model_dir(), runtime) as engine:
        assert "random weights (--load-format dummy)" in engine.summary()
        return [o.output_token_ids for o in engine.generate([[5, 17, 33, 2], [9, 1]], GREEDY)]


def test_random_weights_by_name_and_seeded():
    rt = RuntimeConfig(load_format="dummy", buffer_slots=8)
    loaded = load_checkpoint(default_model_dir(), rt, load_tokenizer=False)
    real = load_checkpoint(default_model_dir(), RuntimeConfig(buffer_slots=8), load_tokenizer=False)
    d, h = loaded.dense, loaded.config.hidden_size
    assert set(d) == set(real.dense) and all(d[k].shape == real.dense[k].shape for k in d)
    assert not torch.equal(d["embed"], real.dense["embed"])  # not the checkpoint's
    assert torch.all(d["layers.0.attn_norm"] == 1) and torch.all(d["final_norm"] == 1)
    assert d["layers.0.router"].std().item() == pytest.approx(ROUTER_LOGIT_STD / math.sqrt(h), rel=0.1)
    assert d["layers.0.q"].std().item() == pytest.approx(0.02, rel=0.1)
    experts = loaded.store.data
    assert experts.std().item() == pytest.approx(0.02, rel=0.05) and not torch.equal(experts[0], experts[1])
    # the same seed: the same weights (whatever the cores)
    again = load_checkpoint(default_model_dir(), rt, load_tokenizer=False)
    assert torch.equal(again.store.data, experts) and torch.equal(again.dense["layers.3.k"], d["layers.3.k"])


def test_dense_init_by_canonical_name():
    assert dense_init("layers.2.o_bias", 64) == ("fill", 0.0)
    assert dense_init("layers.2.sinks", 64) == ("fill", 0.0)
    assert dense_init("layers.2.router_bias", 64) == ("fill", 0.0)  # a router's score bias
    assert dense_init("layers.2.kv_a_norm", 64) == ("fill", 1.0)
    assert dense_init("final_norm_bias", 64) == ("fill", 0.0)
    assert dense_init("layers.2.router", 64) == ("normal", ROUTER_LOGIT_STD / 8)
    assert dense_init("lm_head", 64) == ("normal", 0.02)


def test_engines_serve_random_weights_deterministically_at_a_small_buffer():
    rt = RuntimeConfig(load_format="dummy", buffer_slots=2, max_batch_size=2, max_model_len=32)
    first = _tokens(rt)
    assert first == _tokens(rt) and all(len(t) == 6 for t in first)


def test_quantized_experts_are_drawn_and_quantized():
    rt = RuntimeConfig(load_format="dummy", buffer_slots=2, expert_dtype="int8", max_model_len=32)
    assert all(len(t) == 6 for t in _tokens(rt))


def test_config_only_folder_loads_only_with_dummy(tmp_path, capsys):
    out = tmp_path / "q"
    args = ["make-checkpoint", "--shape", "qwen3-30b-a3b", "--layers", "1", "--shrink", "16"]
    assert main([*args, "--out", str(out), "--config-only"]) == 0
    assert "no weights" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(out, RuntimeConfig())
    assert all(len(t) == 6 for t in _tokens(RuntimeConfig(load_format="dummy", max_model_len=32), out))


def test_bench_decode_on_a_config_only_folder(tmp_path, capsys):
    """The GPU check's use: a real shape's speed with no weights written; the transformers baseline
    from the config with its own random weights."""
    out = tmp_path / "q"
    args = ["make-checkpoint", "--shape", "qwen3-30b-a3b", "--layers", "1", "--shrink", "16"]
    assert main([*args, "--out", str(out), "--config-only"]) == 0
    capsys.readouterr()
    bench = ["bench", "decode", "--model", str(out), "--load-format", "dummy", "--fractions", "1.0"]
    bench += ["--batches", "1", "--prefill-len", "0", "--new-tokens", "3", "--prompt-len", "4", "--json"]
    assert main(bench) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["rows"][0] if "rows" in data else data["results"][0]
    assert data["settings"]["load_format"] == "dummy" and row["tpot_ms"] > 0
    assert row["ratio_vs_transformers"] is not None


def test_unknown_load_format_refused(capsys):
    with pytest.raises(ConfigError, match="--load-format"):
        RuntimeConfig(load_format="pt")
    assert main(["generate", "--load-format", "pt", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--load-format" in err and "'pt'" in err
