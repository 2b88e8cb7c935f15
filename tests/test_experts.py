"""Routed experts as grouped GEMMs: the grouped path, the per-expert loop and any
segmenting of the slot buffer give bit-identical logits, at any buffer size; the path is chosen
once at load and named in the summary."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import moe_runtime.layers.experts as experts
from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44], [3, 3, 8, 120]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _logits(
    path, expert_path: str, dtype: str = "fp32", prompts=PROMPTS, few_tokens: int = 0, **kw
) -> torch.Tensor:
    """Every step's sampled logits, stacked ``[steps * seqs, V]``; steps of at most ``few_tokens``
    tokens take the ``few`` path (0: every step runs ``expert_path``)."""
    runtime = RuntimeConfig(max_model_len=64, max_batch_size=3, dtype=dtype, **kw)
    rows = []
    with (
        mock.patch.dict(experts.FEW_TOKENS, {"cpu": few_tokens}),
        LLMEngine.from_pretrained(path, runtime) as engine,
    ):
        engine.model.expert_path = expert_path
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, PARAMS)
        while engine.has_unfinished():
            engine.step()
            rows.append(engine.last_logits.clone())
    return torch.cat(rows)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_grouped_and_loop_identical_at_any_buffer(tiny_checkpoints, family, monkeypatch):
    path = tiny_checkpoints[family]
    ref = _logits(path, "loop")
    assert torch.equal(_logits(path, "grouped"), ref)
    assert torch.equal(_logits(path, "grouped", buffer_slots=2), ref)
    monkeypatch.setattr(experts, "MAX_GROUPS", 3)  # 16 resident slots -> segments of 3 slots
    assert torch.equal(_logits(path, "grouped"), ref)
    assert torch.equal(_logits(path, "grouped", buffer_slots=5), ref)


def test_grouped_and_loop_identical_in_bf16(tiny_qwen3):
    assert torch.equal(_logits(tiny_qwen3, "grouped", "bf16"), _logits(tiny_qwen3, "loop", "bf16"))


@pytest.mark.parametrize(("dtype", "seqs", "slots"), [("fp32", 1, None), ("bf16", 1, None), ("fp32", 3, 2)])
def test_few_token_steps_identical_to_grouped(monkeypatch, dtype, seqs, slots):
    """Decode steps of up to FEW_TOKENS tokens take the CPU's ``few`` path (resident and landed
    experts, experts shared by several tokens); its logits equal the grouped path's bit for bit.
    The bundled model's top-4 makes the sum order matter."""
    calls = []
    few = experts._few_tokens
    monkeypatch.setattr(experts, "_few_tokens", lambda *a: calls.append(a[0].shape[0]) or few(*a))
    kw = {"dtype": dtype, "prompts": PROMPTS[:seqs], "buffer_slots": slots}
    got = _logits(default_model_dir(), "grouped", few_tokens=experts.FEW_TOKENS["cpu"], **kw)
    assert set(calls) == {seqs}, "the few path did not run (or ran a prefill)"
    calls.clear()
    assert torch.equal(got, _logits(default_model_dir(), "grouped", **kw))
    assert not calls


def test_step_path_by_device_and_tokens():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    n = experts.FEW_TOKENS["cpu"]
    assert n >= 1 and experts.step_path("grouped", cpu, n) == "few"
    assert experts.step_path("grouped", cpu, n + 1) == "grouped"
    assert experts.step_path("loop", cpu, n + 1) == "loop"
    assert experts.step_path("grouped", cuda, 1) == "grouped"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_runs_on_cpu(dtype):
    assert experts.select_expert_path(torch.device("cpu"), dtype) == "grouped"


def test_cuda_needs_16_byte_aligned_widths():
    # checked before any CUDA call: no GPU needed to see the refusal
    cuda = torch.device("cuda", 0)
    assert experts.select_expert_path(cuda, torch.bfloat16, 2048, 772) == "loop"
    assert experts.select_expert_path(cuda, torch.float32, 2046, 768) == "loop"


def test_falls_back_to_the_loop_where_grouped_cannot_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("grouped gemm is only supported on SM >= 80")

    monkeypatch.setattr(F, "grouped_mm", refuse)
    assert experts.select_expert_path(torch.device("cpu"), torch.float32) == "loop"


def test_falls_back_when_grouped_differs_from_linear(monkeypatch):
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda a, b, offs: real(a, b, offs=offs) * 1.0001)
    assert experts.select_expert_path(torch.device("cpu"), torch.float32) == "loop"


def test_summary_names_the_expert_path(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_model_len=32)) as engine:
        assert engine.summary().endswith("experts run grouped")


def _fake_layer(num_experts: int = 6, tokens: int = 4, k: int = 2, hidden: int = 16, inter: int = 8):
    """``(x [T, H], weights [T, k], ids [T, k], handles)`` of one MoE layer whose experts sit in
    slots of a stand-in partition (expert ``e`` in slot ``e``)."""
    from types import SimpleNamespace

    from moe_runtime.buffer.layer_run import ExpertHandle

    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(num_experts, 3 * inter * hidden, generator=gen)
    gate_up = flat[:, : 2 * inter * hidden].unflatten(1, (2 * inter, hidden))
    down = flat[:, 2 * inter * hidden :].unflatten(1, (hidden, inter))
    cpu = torch.device("cpu")
    part = SimpleNamespace(
        device=cpu, gate_up=gate_up, down=down, gate_up_t=gate_up.transpose(1, 2), down_t=down.transpose(1, 2)
    )
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)]).numpy()
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    x = torch.randn(tokens, hidden, generator=gen)
    used = sorted(set(ids.reshape(-1).tolist()))
    handles = [ExpertHandle(e, cpu, False, 0.0, e, part) for e in used]
    return x, weights, ids, handles


class _Batches:
    """A layer run handing out ``batches`` as they are."""

    def __init__(self, batches) -> None:
        self._batches = batches

    def batches(self):
        yield from self._batches


def test_one_landed_expert_runs_its_rows_from_one_upload_with_the_same_bits(monkeypatch):
    """A batch of one expert (the usual miss on a slow link) takes its rows from the layer's one
    upload (``LayerPlan.expert_rows``), not a batch's sort, offsets and upload; the output equals
    the one-batch grouped and loop paths' bit for bit, with and without gpt-oss's biases."""
    x, weights, ids, handles = _fake_layer()
    ran = []
    one_expert = experts._one_expert
    monkeypatch.setattr(experts, "_one_expert", lambda *a: ran.append(a[2].expert) or one_expert(*a))
    gen = torch.Generator().manual_seed(1)
    biased = experts.ExpertFFN(torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen))
    for ffn in (None, biased):
        whole = experts.run_experts(x, weights, ids, _Batches([handles]), 6, "grouped", ffn)[0]
        assert not ran
        loop = experts.run_experts(x, weights, ids, _Batches([handles]), 6, "loop", ffn)[0]
        assert torch.equal(whole, loop)
        for path in ("grouped", "loop"):
            singles = _Batches([[h] for h in reversed(handles)])  # landing order is any order
            got = experts.run_experts(x, weights, ids, singles, 6, path, ffn)[0]
            assert torch.equal(got, whole)
            assert ran == [h.expert for h in reversed(handles)]
            ran.clear()


def test_one_landed_expert_after_the_first_costs_ten_aten_ops():
    """The CPU-checkable proxy of a miss's host cost (kernel launches on a GPU): once the layer's
    rows are gathered (at its first one-expert batch), each further one-expert batch is three
    slices, two ``F.linear``, the SwiGLU (chunk, silu, mul), the router-weight scale and one
    ``index_copy_``: ten aten ops, no gather, select or cast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    x, weights, ids, handles = _fake_layer()
    part = handles[0].part  # per-slot views in a list, as a Partition keeps them (no select op)
    part.gate_up, part.down = list(part.gate_up.unbind(0)), list(part.down.unbind(0))
    per_call = []
    one_expert = experts._one_expert

    def counted(*a):
        before = Count.ops
        with Count():
            one_expert(*a)
        per_call.append(Count.ops - before)

    import unittest.mock

    with unittest.mock.patch.object(experts, "_one_expert", counted), torch.inference_mode():  # as the engine
        experts.run_experts(x, weights, ids, _Batches([[h] for h in handles]), 6, "grouped")
    assert len(per_call) == len(handles) >= 3
    assert per_call[1:] == [10] * (len(handles) - 1)
    assert per_call[0] > 10  # the layer's one upload and gathers


@pytest.mark.parametrize("resident", [True, False])
def test_launched_runs_after_the_resident_batch_and_before_the_first_wait(resident: bool) -> None:
    """``launch_then`` calls the hook (the prefetch plan on an accelerator) once: after the
    caller issued the resident batch, before it asks for the first landed one (that request may
    wait); without a resident batch, before the first one."""
    events: list[str] = []

    class Run:
        resident_first = resident

        def batches(self):
            for name in ("first", "second", "third"):
                events.append(f"next {name}")
                yield [name]

    for batch in experts.launch_then(Run(), lambda: events.append("launched")):
        events.append(f"issue {batch[0]}")
    head = (
        ["next first", "issue first", "launched"] if resident else ["launched", "next first", "issue first"]
    )
    assert events == head + ["next second", "issue second", "next third", "issue third"]
    events.clear()

    class Empty:
        resident_first = False

        def batches(self):
            return iter(())

    assert list(experts.launch_then(Empty(), lambda: events.append("launched"))) == []
    assert events == ["launched"]
