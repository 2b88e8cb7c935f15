"""``moeserve bench decode`` on the made shapes beyond the Llama layout (``--shrink 16``, 2-4 layers).

What the bounds count is recomputed here from the checkpoint's ``config.json`` and transformers'
own model of it, not from moeserve: one token's expert bytes are top-k experts x MoE layers x
(``3 * H * I`` + gpt-oss' expert biases) x 4 bytes (fp32), and the dense bytes a step reads are the
model's tensors less the embedding table and the experts.
"""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout

import pytest
import torch
import transformers

from moeserve.cli import main

PROMPT, NEW = 4, 3
#: shape -> layers kept: the dense-first layers and at least one MoE layer
LAYERS = {"deepseek-v2-lite": 3, "deepseek-v3": 4, "glm-4.5-air": 3, "gpt-oss-20b": 2, "phi-3.5-moe": 2}


def _expected_bytes(cfg: dict) -> tuple[int, int, int]:
    """(dense bytes read per step, expert bytes per token, KV bytes per token) at fp32, from
    ``config.json`` and transformers' model of it on the meta device."""
    hf = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    sd = model.state_dict()
    dense = sum(t.numel() for k, t in sd.items() if ".experts." not in k and "embed_tokens" not in k)
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    expert = 3 * cfg["hidden_size"] * width
    if cfg["model_type"] == "gpt_oss":  # gate_up and down biases, read with the expert
        expert += 2 * width + cfg["hidden_size"]
    moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    if "kv_lora_rank" in cfg:  # latent + shared rotary key per layer
        kv = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv = 2 * cfg["num_key_value_heads"] * head_dim
    return 4 * dense, 4 * cfg["num_experts_per_tok"] * moe_layers * expert, 4 * cfg["num_hidden_layers"] * kv


@pytest.mark.parametrize("name", list(LAYERS))
def test_bench_decode_runs_on_shape(tmp_path, capsys, name):
    out = tmp_path / "ckpt"
    args = ["make-checkpoint", "--shape", name, "--layers", str(LAYERS[name]), "--out", str(out)]
    assert main([*args, "--shrink", "16"]) == 0
    capsys.readouterr()
    buf = io.StringIO()
    bench = ["bench", "decode", "--model", str(out), "--fractions", "1.0,0.25", "--batches", "1"]
    bench += ["--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--prefill-len", "8"]
    bench += ["--link-gbps", "0", "--no-transformers", "--hbm-gbps", "100", "--json"]
    with redirect_stdout(buf):
        assert main(bench) == 0
    data = json.loads(buf.getvalue())
    st, rows = data["settings"], data["results"]
    dense, expert_per_token, kv_per_token = _expected_bytes(json.loads((out / "config.json").read_text()))
    assert st["dense_read_bytes"] == dense and st["kv_bytes_per_token"] == kv_per_token
    assert [r["buffer_fraction"] for r in rows] == [1.0, 0.25]
    for r in rows:
        assert math.isfinite(r["tpot_ms"]) and r["tpot_ms"] > 0
        assert r["expert_bytes_per_token"] == expert_per_token
        # batch 1: the step reads the dense weights and its token's top-k experts per MoE layer
        assert r["weight_bytes_per_step"] == pytest.approx(dense + expert_per_token)
        assert r["kv_bytes_per_step"] == (PROMPT + NEW / 2) * kv_per_token
        assert r["hbm_bound_ms"] == pytest.approx(
            1e3 * (dense + expert_per_token + r["kv_bytes_per_step"]) / 100e9
        )
        assert (r["link_bound_ms"] > 0) == (r["h2d_bytes_per_step"] > 0)
    assert rows[0]["h2d_bytes_per_step"] == 0 and rows[0]["hit_rate"] == 1.0  # all resident
    assert data["prefill"][0]["hbm_bound_ms"] > 0


def test_sliding_layers_read_at_most_their_window():
    """gpt-oss' sliding layers read at most ``sliding_window`` cached tokens; full layers all of them."""
    from types import SimpleNamespace

    from moeserve.bench.decode_bounds import kv_read_bytes

    per_layer = 64  # KV bytes per token and layer
    cfg = SimpleNamespace(num_layers=4, sliding_layers=[0, 2], sliding_window=10)
    assert kv_read_bytes(cfg, 50, 4 * per_layer) == per_layer * (2 * 50 + 2 * 10)
    assert kv_read_bytes(cfg, 6, 4 * per_layer) == 4 * per_layer * 6  # inside the window: all of it
    full = SimpleNamespace(num_layers=4, sliding_layers=[], sliding_window=None)
    assert kv_read_bytes(full, 50, 4 * per_layer) == 4 * per_layer * 50
