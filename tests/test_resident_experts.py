"""The device-routed path of fully resident MoE layers (``moe_runtime.layers.resident_experts``):
the GPU's choice, run here on the CPU. Its logits equal the host-planned grouped path's bit for
bit (every family shape: shared experts, gpt-oss's biases and activation; one token and several;
fp32 and bf16), the tracer, the buffer's counters and the per-request figures see the same
routing, and no MoE layer waits for the host: one device->host copy per step."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

import moe_runtime.layers.experts as experts
import moe_runtime.layers.resident_experts as resident
from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44], [3, 3, 8, 120]]
PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _run(path, routed: bool, seqs: int, dtype: str = "fp32", recorder=None, **kw):
    """(every step's logits, the buffer's counters, each request's expert figures, device-routed
    layer calls), the grouped path at every step size (no few-token path)."""
    calls = []
    real = resident.run_resident

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    runtime = RuntimeConfig(max_model_len=64, max_batch_size=3, dtype=dtype, **kw)
    with (
        mock.patch.dict(experts.FEW_TOKENS, {"cpu": 0}),
        mock.patch.dict(resident.DEVICE_ROUTED, {"cpu": routed}),
        mock.patch("moe_runtime.layers.moe.run_resident", spy),
        LLMEngine.from_pretrained(path, runtime, recorder=recorder) as engine,
    ):
        rows, finals = [], {}
        for i, p in enumerate(PROMPTS[:seqs]):
            engine.add_request(str(i), p, PARAMS)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.expert_stats
            rows.append(engine.last_logits.clone())
        stats = dataclasses.asdict(engine.buffer.stats)
    return torch.cat(rows), stats, finals, calls


def _same_stats(a: dict, b: dict) -> None:
    for key in ("lookups", "hits", "expert_batches", "device_lookups", "device_hits", "demand_bytes"):
        assert a[key] == b[key], key


@pytest.mark.parametrize(("dtype", "seqs"), [("fp32", 1), ("bf16", 1), ("fp32", 3), ("bf16", 3)])
def test_bundled_model_same_bits_and_figures(dtype, seqs):
    got, stats, finals, calls = _run(default_model_dir(), True, seqs, dtype)
    want, want_stats, want_finals, none = _run(default_model_dir(), False, seqs, dtype)
    assert calls and not none
    assert (1 in calls) == (seqs == 1) and any(c > 1 for c in calls)  # one token; rows sorted
    assert torch.equal(got, want)
    _same_stats(stats, want_stats)
    assert finals == want_finals


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_families_same_bits(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    got, _, _, calls = _run(path, True, 3)
    assert calls
    assert torch.equal(got, _run(path, False, 3)[0])


def test_gpt_oss_biases_and_activation_same_bits(tmp_path):
    from test_gpt_oss import make_gpt_oss_checkpoint

    path = make_gpt_oss_checkpoint(tmp_path / "tiny")
    got, _, _, calls = _run(path, True, 3)
    assert calls
    assert torch.equal(got, _run(path, False, 3)[0])


def test_not_below_a_full_buffer():
    """Offloading (a buffer below 100%) keeps the host-planned path."""
    _, _, _, calls = _run(default_model_dir(), True, 1, buffer_fraction=0.5)
    assert not calls


def test_tracer_records_the_same_routing():
    from tracer.eamc import EAMC
    from tracer.recorder import RequestRecorder

    entries = []
    for routed in (True, False):
        eamc = EAMC(8, 64, capacity=8)
        _run(default_model_dir(), routed, 3, recorder=RequestRecorder(8, 64, 4, eamc=eamc))
        entries.append(eamc.entries())
    assert len(entries[0]) == 3 and np.array_equal(entries[0], entries[1])


def test_one_host_copy_per_step_not_per_layer(monkeypatch):
    """No MoE layer of a decode step calls ``.cpu()``; the step's end copies every layer's ids once."""
    import moe_runtime.layers.moe as moe
    import moe_runtime.model as model_mod

    per_layer, per_step = [], []
    block, forward = model_mod.moe_block, model_mod.MoEModel.forward

    class _Cpu(torch.overrides.TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += getattr(func, "__name__", "") == "cpu"
            return func(*args, **(kwargs or {}))

    def counted_block(*args, **kwargs):
        with _Cpu() as c:
            out = block(*args, **kwargs)
        per_layer.append(c.n)
        return out

    def counted_forward(self, ids, step):
        with _Cpu() as c:
            out = forward(self, ids, step)
        per_step.append(c.n)
        return out

    monkeypatch.setattr(model_mod, "moe_block", counted_block)
    monkeypatch.setattr(model_mod.MoEModel, "forward", counted_forward)
    assert moe.run_resident is resident.run_resident
    _, _, _, calls = _run(default_model_dir(), True, 1)
    assert calls and set(per_layer) == {0} and set(per_step) == {1}
