"""``moeserve bench launches`` on the CPU: the aten-op count of decode steps, and the profiled
pass that a GPU runs (its host events and wall time; no kernels here)."""

from __future__ import annotations

import argparse
import json

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moeserve.bench.launches import measure
from moeserve.cli import main

ARGS = argparse.Namespace(prompt_len=8, new_tokens=4, seed=0)


def test_counts_ops_per_decoder_layer(capsys):
    assert (
        main(["bench", "launches", "--device", "cpu", "--batches", "1,2", "--new-tokens", "3", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_steps"] == 2 and r["decoder_layers"] == 8
        assert 10 < r["launching_ops_per_layer"] < r["ops_per_layer"] < 200


def test_profiled_pass_lists_host_events():
    runtime = RuntimeConfig(max_model_len=32, max_batch_size=1, dtype="bf16")
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        row = measure(engine, 1, ARGS, profiled_run=True)
    assert row["decode_steps"] == 3 and "ops_per_layer" not in row
    assert row["launches_per_step"] == row["kernels_per_step"] == 0  # no CUDA here
    assert row["profiled_step_us"] > 0
    # eager steps: every outermost aten op is a kernel call, none generated
    assert 10 < row["kernel_calls_per_layer"] < 200 and row["generated_kernels_per_step"] == 0
    names = [name for name, calls, us in row["host_top"]]
    assert any(n.startswith("aten::") for n in names) and all(us >= 0 for _, _, us in row["host_top"])


def test_flex_attention_decode_is_profiled_not_counted():
    """FlexAttention refuses a dispatch mode (found on an H100: the bench failed there). Where the
    cache decodes through it (eager here), the bench profiles instead of counting aten ops."""
    from moe_runtime.layers.kv_cache import cdiv
    from moe_runtime.layers.paged_decode import FlexPagedDecode

    runtime = RuntimeConfig(max_model_len=32, max_batch_size=1, dtype="bf16")
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        kv = engine.kv
        kv.flex = FlexPagedDecode(
            kv.num_blocks,
            kv.block_size,
            1,
            cdiv(32, kv.block_size),
            len(kv.windows),
            kv._kv.device,
            compiled=False,
        )
        row = measure(engine, 1, ARGS)
    assert "ops_per_layer" not in row and row["profiled_step_us"] > 0
