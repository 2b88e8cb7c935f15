"""Hybrid expert execution against transformers for every family (the oracle).

At a 2-slot buffer, ``--expert-compute cpu`` (every miss on the CPU, a fixed resident set) and
``auto`` over an emulated link (misses split between the CPU and the link) give transformers'
greedy tokens and fp32 logits within the oracle tests' tolerance, for one prompt and a batch of
prompts of different lengths, and on this CPU the same logits bit for bit as ``device`` (the CPU
kernel is ``F.linear`` on the store's rows; each token's sum keeps ascending expert order).
Families: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE, DeepSeek-V2 (two variants) and V3
(latent attention), GLM-4.5, Phi-3.5-MoE, gpt-oss (expert biases, clamped SwiGLU; and with MXFP4
experts through the compiled CPU kernel).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_oracle import _run_collecting_logits, assert_matches, greedy_references
from tiny_models import (
    DEEPSEEK_VARIANTS,
    make_deepseek_checkpoint,
    make_glm4_moe_checkpoint,
    make_gpt_oss_checkpoint,
    make_phimoe_checkpoint,
)

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

PROMPTS = [[5, 17, 33, 2, 250, 7, 91, 12], [9, 1, 44], [100, 101, 102, 103, 104, 105]]
NEW = 8
MODES = {"device": None, "cpu": None, "auto": 0.05}  # mode -> emulated link, GB/s
BUILDERS = {
    **{
        v: (lambda p, v=v, i=i: make_deepseek_checkpoint(v, p, seed=i))
        for i, v in enumerate(DEEPSEEK_VARIANTS)
    },
    "glm4_moe": make_glm4_moe_checkpoint,
    "phimoe": make_phimoe_checkpoint,
    "gpt_oss": make_gpt_oss_checkpoint,
}
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", *BUILDERS]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {**tiny_checkpoints, **{name: build(root / name) for name, build in BUILDERS.items()}}


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_and_auto_match_transformers_and_device(checkpoints, family):
    path = checkpoints[family]
    _, refs = greedy_references(path, PROMPTS, NEW)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = {}
    for mode, link in MODES.items():
        rt = RuntimeConfig(
            buffer_slots=2, max_model_len=64, max_batch_size=3, expert_compute=mode, link_gbps=link
        )
        with LLMEngine.from_pretrained(path, rt) as engine:
            got[mode] = _run_collecting_logits(engine, PROMPTS[:1], params) + _run_collecting_logits(
                engine, PROMPTS, params
            )
            st = engine.buffer.stats
        assert (sum(st.cpu_experts) > 0) == (mode != "device"), mode
        if mode == "cpu":
            assert st.demand_bytes == st.prefetch_bytes == 0
        assert_matches(got[mode], refs[:1] + refs)
    for mode in ("cpu", "auto"):
        for (tokens, logits), (dev_tokens, dev_logits) in zip(got[mode], got["device"]):
            assert tokens == dev_tokens and torch.equal(logits, dev_logits), mode


def test_gpt_oss_mxfp4_experts_through_the_compiled_kernel(checkpoints, monkeypatch):
    """gpt-oss with MXFP4 experts (``--expert-dtype mxfp4``), every miss on the CPU through
    ``mxfp4-gemv`` (forced: at the tiny shape torch's may measure faster), its biases and clamped
    SwiGLU between the kernel's projections: device's greedy tokens, logits within rounding."""
    import moe_runtime.hybrid.setup as setup

    eligible = setup.eligible_kernels
    monkeypatch.setattr(
        setup, "eligible_kernels", lambda store: [k for k in eligible(store) if "gemv" in k.name]
    )
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = {}
    for mode in ("device", "cpu"):
        rt = RuntimeConfig(
            buffer_slots=2, max_model_len=64, max_batch_size=3, expert_compute=mode, expert_dtype="mxfp4"
        )
        with LLMEngine.from_pretrained(checkpoints["gpt_oss"], rt) as engine:
            got[mode] = _run_collecting_logits(engine, PROMPTS, params)
            assert mode == "device" or "mxfp4-gemv" in engine.summary()
    for (tokens, logits), (dev_tokens, dev_logits) in zip(got["cpu"], got["device"]):
        assert tokens == dev_tokens
        torch.testing.assert_close(logits, dev_logits, rtol=1e-4, atol=1e-4)
