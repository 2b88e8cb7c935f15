"""Decode steps through the compiled forward on the CPU (``moe_runtime.engine.compiled_decode``):
the eager engine's greedy tokens and (to fp32 rounding) logits at batch 1 and 3 with sequences of
different lengths, the same buffer counters and per-request expert figures, no compile after the
start-up warm-up, eager steps where it does not apply or the compile fails, and ``moeserve serve``
compiling before it serves."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from serve_helpers import free_port, wait_healthy

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moeserve.bench.launches import measure
from moeserve.cli import build_parser
from moeserve.commands.common import runtime_from_args

PROMPTS = [[5, 17, 33, 2, 250, 7, 9, 11], [9, 1, 44], list(range(40, 61))]  # three lengths
# TorchInductor builds C++ on the CPU: without a compiler the compiled tests have nothing to run
# (the fallback test below needs none)
needs_cxx = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="torch.compile on the CPU needs a C++ compiler"
)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(model, compiled: bool, fraction: float = 1.0) -> LLMEngine:
    """An engine on ``model`` with the settings the serve test passes too (the compiled graphs
    then come from TorchInductor's cache there: the pool's size is part of their shapes)."""
    rt = RuntimeConfig(max_model_len=96, max_batch_size=3, buffer_fraction=fraction, compile_decode=compiled)
    return LLMEngine.from_pretrained(model, rt)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict, list[torch.Tensor], dict]:
    """(tokens per request, every decode step's logits, expert figures per request)."""
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, PARAMS)
    tokens, logits, stats = {}, [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                i = int(out.request_id.split("-")[1])
                tokens[i], stats[i] = out.output_token_ids, out.expert_stats
        logits.append(engine.last_logits.clone())
    return tokens, logits, stats


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    eager, compiled = _engine(tiny_qwen3, False), _engine(tiny_qwen3, True)
    variants, _ = compiled.capture_graphs()
    yield eager, compiled, variants
    eager.close()
    compiled.close()


@needs_cxx
def test_start_up_compiles_every_variant_once(engines):
    _, compiled, variants = engines
    assert variants == 2 and compiled.compiled.compiles >= 2 and compiled.compiled.enabled
    assert "decode steps compiled" in compiled.summary()


@needs_cxx
@pytest.mark.parametrize("seqs", [1, 3])
def test_compiled_steps_give_the_eager_tokens_and_logits(engines, seqs):
    eager, compiled, _ = engines
    compiles, steps = compiled.compiled.compiles, compiled.compiled.steps
    want_tokens, want_logits, want_stats = _run(eager, PROMPTS[:seqs])
    got_tokens, got_logits, got_stats = _run(compiled, PROMPTS[:seqs])
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # every decode step ran compiled (the first step of each request is its prefill) ...
    assert compiled.compiled.steps - steps == len(got_logits) - 1
    # ... and none compiled: the warm-up met the batch sizes, lengths and masks beforehand
    assert compiled.compiled.compiles == compiles
    # the router ids reached the buffer's counters and the per-request figures as eagerly
    for i in want_stats:
        assert (got_stats[i].lookups, got_stats[i].hits) == (want_stats[i].lookups, want_stats[i].hits)


@needs_cxx
def test_a_compiled_step_is_a_few_kernel_calls_per_layer(engines):
    """The CPU proxy for launches where steps run compiled (``moeserve bench launches
    --compile-decode``): each generated loop and library call of a decode step, and each aten op of
    the bookkeeping around the compiled forward, over the whole step per decoder layer. At most 15
    at batch 1 on this 2-layer model (13 measured: 9 a layer, the embedding and the LM head, 6 ops
    around; 10.1 on the 8-layer bundled model), against about 40 aten ops a layer in an eager step
    (``tests/test_op_counts.py``). Live: the generated loops are counted, not only library calls."""
    _, compiled, _ = engines
    row = measure(compiled, 1, argparse.Namespace(prompt_len=8, new_tokens=4, seed=0))
    assert row["compiled_steps"] == row["decode_steps"] == 3
    assert row["generated_kernels_per_layer"] >= 2, row
    assert row["eager_ops_per_step"] <= 8, row
    assert 4 <= row["kernel_calls_per_layer"] <= 15, row


@needs_cxx
def test_buffer_counters_match_eager(tiny_qwen3):
    """Fresh engines, the same requests: the buffer's lookups and hits agree."""
    with _engine(tiny_qwen3, False) as eager, _engine(tiny_qwen3, True) as compiled:
        compiled.capture_graphs()
        _run(eager, PROMPTS)
        _run(compiled, PROMPTS)
        a, b = dataclasses.asdict(eager.buffer.stats), dataclasses.asdict(compiled.buffer.stats)
    for key in ("lookups", "hits", "device_lookups", "device_hits", "demand_bytes"):
        assert a[key] == b[key], key


def test_offloaded_experts_run_eagerly(tiny_qwen3):
    """Half the experts offloaded: no step is eligible, nothing compiles, the eager tokens."""
    with _engine(tiny_qwen3, False, 0.5) as eager, _engine(tiny_qwen3, True, 0.5) as engine:
        assert engine.capture_graphs()[0] == 0
        assert _run(engine, PROMPTS)[0] == _run(eager, PROMPTS)[0]
        assert engine.compiled.steps == engine.compiled.compiles == 0


def test_a_failed_compile_serves_eagerly(engines, tiny_qwen3, caplog):
    eager = engines[0]
    with _engine(tiny_qwen3, True) as engine:

        def broken(*args, **kwargs):
            raise RuntimeError("no C++ compiler found\nmore detail")

        engine.compiled._fn = broken
        with caplog.at_level(logging.WARNING):
            tokens = _run(engine, PROMPTS)[0]
        assert tokens == _run(eager, PROMPTS)[0]
        assert not engine.compiled.enabled and engine.compiled.steps == 0
        assert "compiled decode off: no C++ compiler found" in caplog.text
        assert "decode steps eager (the compile failed)" in engine.summary()


def test_serve_compiles_only_unless_enforce_eager():
    parse = build_parser().parse_args
    assert runtime_from_args(parse(["serve"]), compile_decode=True).compile_decode
    assert not runtime_from_args(parse(["serve", "--enforce-eager"]), compile_decode=True).compile_decode
    assert not runtime_from_args(parse(["generate", "--prompt", "x"])).compile_decode


@needs_cxx
def test_serve_compiles_before_serving(engines, tiny_qwen3):
    """``moeserve serve`` compiles its decode step at start, says so, then answers (the
    compiler's cache, warm from the engines above at the same settings, keeps this short)."""
    port = free_port()
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(tiny_qwen3), "--port", str(port)]
    cmd += ["--max-batch-size", "3", "--max-model-len", "96", "--dtype", "fp32"]
    cmd += ["--log-level", "warning", "--max-wait-ms", "0", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 240)
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "compiling the decode step" in err and "compiled decode step: 2 variants in" in err
