"""Several devices (emulated on CPU) and CUDA (skipped cleanly without it)."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44]]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _tokens(path, **kw):
    with LLMEngine.from_pretrained(path, RuntimeConfig(max_model_len=64, max_batch_size=2, **kw)) as engine:
        outs = engine.generate(PROMPTS, PARAMS)
        return [o.output_token_ids for o in outs], engine.buffer.stats


def test_emulated_devices_give_identical_outputs(tiny_checkpoints):
    path = tiny_checkpoints["mixtral"]
    ref, _ = _tokens(path)
    got, stats = _tokens(path, num_devices=3, buffer_slots=3)
    assert got == ref
    assert all(n > 0 for n in stats.device_lookups) and len(stats.device_lookups) == 3
    assert stats.demand_bytes > 0


def test_a_batch_over_several_devices_runs_its_experts_before_any_output_returns(
    tiny_checkpoints, monkeypatch
):
    """Experts homed on several GPUs run at once only if no partition's output copy (which waits
    for the work queued on both devices) comes between their launches: per batch, every
    partition's experts, then every partition's outputs (emulated devices, same tokens)."""
    import moe_runtime.layers.experts as experts

    events: list[str] = []

    def logged(fn, what):
        def call(*args, **kwargs):
            events.append(what)
            return fn(*args, **kwargs)

        return call

    calls = experts.LayerPlan.calls
    monkeypatch.setattr(
        experts.LayerPlan, "calls", lambda self, batch: (events.append("|"), calls(self, batch))[1]
    )
    for name in ("_grouped", "_loop"):
        monkeypatch.setattr(experts, name, logged(getattr(experts, name), "run"))
    monkeypatch.setattr(experts, "_cast", logged(experts._cast, "out"))
    path = tiny_checkpoints["mixtral"]
    got, _ = _tokens(path, num_devices=3, buffer_slots=24)
    batches = [b for b in "".join(e if e == "|" else e[0] for e in events).split("|") if b]
    assert any(b.count("r") > 1 for b in batches), batches  # batches of several partitions were seen
    assert all(b == "r" * b.count("r") + "o" * b.count("o") for b in batches), batches
    monkeypatch.undo()
    assert got == _tokens(path)[0]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_cuda_matches_cpu_with_eviction(tiny_checkpoints, family):
    """Copy stream + events + pinned memory: a 2-slot CUDA buffer gives the CPU's greedy tokens."""
    path = tiny_checkpoints[family]
    ref, _ = _tokens(path)
    got, stats = _tokens(path, device="cuda", buffer_slots=2)
    assert got == ref
    assert stats.demand_bytes > 0
    # every copy timed on the copy stream (events): a positive time, under a second each
    assert stats.copies > 0
    assert 0 < stats.copy_s / stats.copies < 1.0


@pytest.mark.gpu
@gpu
def test_cuda_host_store_is_pinned_and_slots_on_device(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(device="cuda", buffer_slots=2)) as engine:
        assert engine.loaded.store.data.is_pinned()
        assert all(p.slots.is_cuda for p in engine.buffer.parts)
        assert engine.loaded.dense["embed"].is_cuda


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_cuda_devices(tiny_qwen3):
    ref, _ = _tokens(tiny_qwen3)
    got, stats = _tokens(tiny_qwen3, device="cuda", num_devices=2, buffer_slots=4)
    assert got == ref and all(n > 0 for n in stats.device_lookups)


@pytest.mark.gpu
@gpu
def test_cuda_bf16_grouped_experts_match_the_loop(tiny_qwen3):
    """On CUDA in bf16 the load probe picks grouped GEMMs (where the device runs them) and they
    give the per-expert loop's logits bit for bit, at a 2-slot buffer too."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    runtime = RuntimeConfig(device="cuda", dtype="bf16", max_model_len=64, max_batch_size=2, buffer_slots=2)
    logits = {}
    for path in ("grouped", "loop"):
        with LLMEngine.from_pretrained(tiny_qwen3, runtime) as engine:
            picked = engine.model.expert_path
            assert engine.summary().endswith(f"experts run {picked}")
            if picked != "grouped":
                pytest.skip(f"grouped_mm does not run here (capability {torch.cuda.get_device_capability()})")
            engine.model.expert_path = path
            engine.generate(PROMPTS, params)
            logits[path] = engine.last_logits.clone()
    assert torch.equal(logits["grouped"], logits["loop"])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("masked", [True, False])
def test_cuda_decode_attention_runs_without_the_math_fallback(masked):
    """Decode attention at a real GQA shape (Qwen3-30B-A3B: 32 query heads over 4 KV heads, head
    dim 128, bf16) runs with only the flash and memory-efficient kernels allowed, and matches the
    math kernel's grouped-query result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moe_runtime.layers.attention import decode_grouped

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, c, d = 4, 32, 4, 77, 128
    q = torch.randn(b, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    keys, vals = torch.randn(2, b, hkv, c, d, generator=g, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([77, 5, 40, 61], device="cuda") if masked else torch.full((b,), c, device="cuda")
    visible = (torch.arange(c, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2).float(), keys.float(), vals.float(), attn_mask=visible, enable_gqa=True
        )
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = decode_grouped(q, keys, vals, visible if masked else None)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
def test_cuda_seeded_sampling_is_reproducible(tiny_qwen3):
    """A sampled request's generator lives on the logits' device (a CPU generator made every
    sampled request on CUDA fail), and a seed gives the same tokens again."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    runtime = RuntimeConfig(device="cuda", max_model_len=64, max_batch_size=2, buffer_slots=2)
    runs = []
    for _ in range(2):
        with LLMEngine.from_pretrained(tiny_qwen3, runtime) as engine:
            runs.append([o.output_token_ids for o in engine.generate(PROMPTS, params)])
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grouped_expert_path_never_synchronises(dtype):
    """Where the probe picks ``grouped`` for a dtype, a grouped call runs with no host sync (a
    synchronising fallback would stall every MoE layer and break graph capture); bf16 on an
    H100/H200 is grouped."""
    import torch.nn.functional as F

    from moe_runtime.layers.experts import select_expert_path

    dev = torch.device("cuda", torch.cuda.current_device())
    path = select_expert_path(dev, dtype)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability(dev)[0] in (9, 10):
        assert path == "grouped"
    if path == "grouped":
        x = torch.randn(8, 64, device=dev, dtype=dtype)
        w = torch.randn(4, 64, 32, device=dev, dtype=dtype)
        offs = torch.tensor([2, 2, 5, 8], device=dev, dtype=torch.int32)
        torch.cuda.set_sync_debug_mode("error")
        try:
            F.grouped_mm(x, w, offs=offs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
