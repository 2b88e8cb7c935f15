"""The memory plan's split of device memory between KV blocks and expert slots: its arithmetic on
real shapes, the cap, the overrides, the refusal when the dense part does not fit, and the curves
it weighs (moe_runtime.memory_split, hit_curve, plan_data)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_runtime.config import RuntimeConfig
from moe_runtime.errors import ConfigError, InsufficientMemoryError
from moe_runtime.hit_curve import default_routing, routing_from_eams, zipf_exponent
from moe_runtime.loader import read_model_config
from moe_runtime.memory_plan import plan_memory
from moe_runtime.memory_split import _Sizes, device_budgets, hardware, resolve_split
from moe_runtime.plan_data import AZURE_CONVERSATION, read_plan_data
from moeserve.checkpoints.shapes import SHAPES, hf_config
from tracer.eamc import EAMC
from tracer.trace_file import TraceRecord, write_traces

GB = 10**9
MiB = 1 << 20


@pytest.fixture(scope="module")
def bundled():
    """The bundled model's folder (8 MoE layers x 64 experts, top-4: 512 experts of 96 KiB in fp32)."""
    from moe_runtime.assets import default_model_dir

    return default_model_dir()


def real_config(tmp_path_factory, name: str):
    s = SHAPES[name]
    folder = tmp_path_factory.mktemp(name)
    hf_config(s, s.num_layers, "bfloat16").save_pretrained(folder)
    return read_model_config(folder)[1]


def device_need(cfg, split) -> int:
    """Bytes the split takes of the device: dense, activations, KV pool, every slot at an expert's
    size (the plan's own count, through ``plan_memory``)."""
    plan = plan_memory(cfg, split.runtime)
    return plan.dense + plan.activations + plan.kv_cache + sum(plan.buffer_slots) * plan.expert_bytes


@pytest.fixture
def one_gpu(monkeypatch):
    """CUDA 'available' with one device, ``cuda:0`` (no GPU touched: the plan's arithmetic only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


# (shape, device GB) -> the split the plan chooses on a CUDA device of that size with all of it free
# at the defaults (bf16, batch 16, 4,096 positions, 4,096 tokens per step, utilization 0.9, decode
# graphs): (expert slots, KV blocks). README's GPU quick start quotes the 24 GB qwen3 row.
REAL = {
    ("qwen3-30b-a3b", 80): (6144, 4096),  # every expert resident, KV the batch at full length
    ("qwen3-30b-a3b", 24): (1280, 2834),  # 16 sequences at p90, 21% of experts
    ("mixtral-8x7b", 80): (171, 2882),
    ("mixtral-8x7b", 24): (28, 2874),
}


@pytest.mark.parametrize(
    ("name", "gb", "want"),
    [(n, g, w) for (n, g), w in REAL.items()],
    ids=[f"{n}-{g}GB->{w[0]}slots-{w[1]}blocks" for (n, g), w in REAL.items()],
)
def test_split_on_real_shapes(tmp_path_factory, one_gpu, name, gb, want):
    cfg = real_config(tmp_path_factory, name)
    runtime = RuntimeConfig(dtype="bf16", device="cuda")
    measured = {"cuda:0": (gb * GB, gb * GB)}
    split = resolve_split(cfg, runtime, measured=measured, hw=hardware(runtime, cuda=True))
    print(f"\n{name} on {gb} GB:\n{split.describe()}")
    assert (split.slots, split.num_kv_blocks) == want
    assert split.runtime.buffer_slots == split.slots and split.runtime.num_kv_blocks == split.num_kv_blocks
    assert device_need(cfg, split) <= split.budget == int(0.9 * gb * GB)
    # KV holds the batch at the Azure p90 (2,820 tokens: 177 blocks of 16 each)
    assert split.num_kv_blocks >= 16 * 177
    assert "16 sequences of 2820 tokens (p90, Azure" in split.why


def test_split_never_exceeds_the_cap(bundled):
    cfg = read_model_config(bundled)[1]
    for mib in (12, 16, 24, 40, 64, 96, 200):
        for batch in (1, 4, 16):
            for util in (0.5, 0.9, 1.0):
                runtime = RuntimeConfig(
                    device_memory=mib * MiB, gpu_memory_utilization=util, max_batch_size=batch,
                    max_model_len=256, max_num_batched_tokens=256, link_gbps=0.5,
                )  # fmt: skip
                try:
                    split = resolve_split(cfg, runtime)
                except InsufficientMemoryError:
                    continue
                assert device_need(cfg, split) <= split.budget == int(util * mib * MiB)
                assert 1 <= split.slots <= cfg.num_moe_layers * cfg.num_experts
                assert split.num_kv_blocks >= _Sizes(cfg, runtime, {}).min_blocks


def tiny_runtime(**kw) -> RuntimeConfig:
    base = dict(device_memory=24 * MiB, max_batch_size=4, max_model_len=256, max_num_batched_tokens=256)
    return RuntimeConfig(**{**base, **kw})


def test_overrides_fix_their_part_and_the_plan_fills_the_rest(bundled):
    cfg = read_model_config(bundled)[1]
    sizes = _Sizes(cfg, tiny_runtime(), device_budgets(tiny_runtime()))
    planned = resolve_split(cfg, tiny_runtime())
    # the slots fixed: the KV cache takes the rest, at most the batch at --max-model-len
    fixed = resolve_split(cfg, tiny_runtime(buffer_fraction=0.05))
    assert fixed.slots == 26 and fixed.num_kv_blocks == min(sizes.cap_blocks, sizes.max_blocks(26))
    assert fixed.num_kv_blocks == sizes.cap_blocks == 4 * 16  # the batch of 4 at 256 positions
    assert resolve_split(cfg, tiny_runtime(buffer_slots=26)).runtime.num_kv_blocks == fixed.num_kv_blocks
    # the pool fixed, by blocks or bytes: the slots take the rest
    for kw in ({"num_kv_blocks": 20}, {"kv_cache_memory": 20 * sizes.block + 5}):
        split = resolve_split(cfg, tiny_runtime(**kw))
        assert split.num_kv_blocks == 20 and split.slots == sizes.max_slots(20) > planned.slots
        assert device_need(cfg, split) <= split.budget
    # both fixed: kept when they fit, refused with the numbers when they do not
    both = resolve_split(cfg, tiny_runtime(buffer_slots=10, num_kv_blocks=20))
    assert (both.slots, both.num_kv_blocks) == (10, 20)
    with pytest.raises(
        InsufficientMemoryError, match=r"the settings given need .*KV cache .*--num-kv-blocks 20"
    ):
        resolve_split(cfg, tiny_runtime(buffer_slots=500, num_kv_blocks=20))
    with pytest.raises(ConfigError, match="cannot hold|needs 16"):
        resolve_split(cfg, tiny_runtime(kv_cache_memory=sizes.block))


def test_dense_part_that_does_not_fit_is_one_line_with_the_numbers(bundled):
    cfg = read_model_config(bundled)[1]
    with pytest.raises(InsufficientMemoryError) as err:
        resolve_split(cfg, tiny_runtime(device_memory=8 * MiB), source="m")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("m: the memory plan may take 7.20 MiB of cpu")
    for part in (
        "dense part alone needs",
        "dense weights 5.76 MiB",
        "activations",
        "--max-num-batched-tokens 256",
    ):
        assert part in msg


def test_no_plan_on_the_cpu_without_device_memory(bundled):
    cfg = read_model_config(bundled)[1]
    runtime = RuntimeConfig(max_batch_size=2)
    split = resolve_split(cfg, runtime)
    assert not split.planned and split.runtime == runtime and split.describe() == ""
    assert sum(plan_memory(cfg, runtime).buffer_slots) == cfg.num_moe_layers * cfg.num_experts


def test_cuda_budget_is_the_share_of_the_device_capped_by_free_memory(one_gpu):
    runtime = RuntimeConfig(device="cuda")
    dev = torch.device("cuda", 0)
    budget, words = device_budgets(runtime, {"cuda:0": (80 * GB, 80 * GB)})[dev]
    assert budget == 72 * GB and words == "0.90 x 74.51 GiB of cuda:0"
    # others (here also our CUDA context) hold memory: what is free less the 10% kept back
    budget, words = device_budgets(runtime, {"cuda:0": (79 * GB, 80 * GB)})[dev]
    assert budget == 71 * GB and words.endswith(", capped: 73.57 GiB free less 0.10 x the device kept back")
    assert device_budgets(runtime, {"cuda:0": (70 * GB, 80 * GB)})[dev][0] == 62 * GB
    assert device_budgets(runtime, {"cuda:0": (5 * GB, 80 * GB)})[dev][0] == 0  # the plan refuses
    # --device-memory stands for the device's own size, still within what is free
    small = RuntimeConfig(device="cuda", device_memory=24 * GB, gpu_memory_utilization=0.5)
    assert device_budgets(small, {"cuda:0": (79 * GB, 80 * GB)})[dev][0] == 12 * GB


def test_slots_buy_hits_along_the_curve():
    assert zipf_exponent(8, 2) == pytest.approx(0.5) and zipf_exponent(128, 8) == pytest.approx(0.92)
    routing = default_routing(48, 128, 8)
    total = 48 * 128
    for c in (1, 4, 16):
        d = routing.demand(c)
        rates = [d.hit_rate(s) for s in range(0, total + 1, 256)]
        assert rates == sorted(rates) and rates[0] == 0 and d.hit_rate(total) == pytest.approx(1.0)
        assert d.distinct <= total and d.misses(total) == pytest.approx(0.0, abs=1e-9)
    # a batch spreads over more experts: the same slots hit less
    assert (
        routing.demand(1).hit_rate(1000)
        > routing.demand(4).hit_rate(1000)
        > routing.demand(16).hit_rate(1000)
    )
    assert routing.demand(1).distinct == pytest.approx(48 * 8)


def test_recorded_requests_give_the_curve_and_the_lengths(tmp_path):
    L, E, k = 2, 8, 2
    rng = np.random.default_rng(0)
    records = []
    for i in range(6):  # each request sticks to two experts per layer
        picks = np.stack([rng.choice(E, 2, replace=False) for _ in range(L)])
        ids = np.tile(picks, (10 + i, 1, 1))
        records.append(
            TraceRecord(f"r{i}", None, 4, L, E, k, 4, ids, np.full(ids.shape, 0.5, dtype=np.float32))
        )
    trace = tmp_path / "t.jsonl"
    write_traces(trace, records)
    data = read_plan_data((str(trace),), L, E, k)
    assert data.lengths.quantile(0.0) == 10 and data.lengths.quantile(1.0) == 15
    assert data.routing.source.startswith("6 recorded requests")
    one = data.routing.demand(1)
    assert one.distinct == pytest.approx(L * k) and one.hit_rate(L * k) == pytest.approx(1.0)
    eamc = EAMC(L, E, capacity=8)
    for r in records:
        eamc.add(r.eam().astype(np.float32))
    eamc.save(tmp_path / "e.npz")
    from_eamc = read_plan_data((str(tmp_path / "e.npz"),), L, E, k)
    assert from_eamc.lengths is AZURE_CONVERSATION and from_eamc.routing.demand(1).distinct == pytest.approx(
        L * k
    )
    with pytest.raises(ConfigError, match=r"t.jsonl: its EAMs are 2 layers x 8 experts, the model has 3 x 8"):
        read_plan_data((str(trace),), 3, E, k)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"format": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"--plan-data .*bad.jsonl"):
        read_plan_data((str(tmp_path / "bad.jsonl"),), L, E, k)
    assert routing_from_eams(np.ones((1, L, E)), k, "x").demand(1).distinct == pytest.approx(L * k)


def test_azure_lengths_are_the_trace_quantiles(shared_data):
    """The baked-in quantiles equal the trace's (prompt plus output tokens)."""
    import csv

    with (shared_data / "arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv").open() as f:
        lengths = [int(r["ContextTokens"]) + int(r["GeneratedTokens"]) for r in csv.DictReader(f)]
    for q, tokens in AZURE_CONVERSATION.points:
        assert round(float(np.quantile(lengths, q))) == tokens
    assert AZURE_CONVERSATION.mean() == pytest.approx(np.mean(lengths), rel=0.05)


def test_plan_sizes_for_recorded_traffic(bundled, tmp_path):
    """With --plan-data the KV side is sized at the recorded lengths' p90 and the slots along the
    recorded requests' curve; the load summary says so."""
    cfg = read_model_config(bundled)[1]
    rng = np.random.default_rng(1)
    records = []
    for i in range(20):
        n = 40 + 2 * i  # lengths 40..78: p90 74 tokens
        ids = np.stack([rng.choice(64, (8, 4), replace=True) for _ in range(n)])
        w = np.full(ids.shape, 0.25, dtype=np.float32)
        records.append(TraceRecord(f"r{i}", None, 10, 8, 64, 4, 10, ids, w))
    write_traces(tmp_path / "t.jsonl", records)
    runtime = tiny_runtime(plan_data=(str(tmp_path / "t.jsonl"),))
    split = resolve_split(cfg, runtime)
    assert "4 sequences of 74 tokens (p90, 20 recorded requests)" in split.why
    assert "hit-rate curve of 20 recorded requests (t.jsonl)" in split.why
    assert device_need(cfg, split) <= split.budget
    with pytest.raises(ConfigError, match="--plan-data .*missing.jsonl"):
        resolve_split(cfg, tiny_runtime(plan_data=(str(tmp_path / "missing.jsonl"),)))


def test_capped_probabilities_sum_to_top_k_and_stay_at_most_1():
    from moe_runtime.hit_curve import capped

    rng = np.random.default_rng(0)
    for _ in range(200):
        e = int(rng.integers(2, 40))
        k = int(rng.integers(1, e + 1))
        w = rng.pareto(0.5, size=(3, e)) * (rng.random((3, e)) > 0.3)  # heavy tails, some zeros
        p = capped(w, k)
        assert np.allclose(p.sum(-1), np.minimum((w > 0).sum(-1), k)) and (p <= 1 + 1e-12).all()


def test_cuda_activations_count_the_repeated_kv_heads(one_gpu):
    """On CUDA a masked grouped-query SDPA call repeats the K/V heads to the query heads
    (``attention.sdpa_gqa``): the plan counts that copy of the gathered K/V, ``Hq / Hkv`` times
    the gathered bytes where the CPU counts one more copy."""
    from moe_runtime.assets import default_model_dir
    from moe_runtime.engine.kv_setup import kv_cache_len
    from moe_runtime.memory_plan import activation_bytes, itemsize

    cfg = read_model_config(default_model_dir())[1]
    cpu = RuntimeConfig(max_batch_size=4)
    cuda = RuntimeConfig(device="cuda", max_batch_size=4, cuda_graphs=False)
    g = cfg.num_heads // cfg.num_kv_heads
    assert g == 2
    gathered = 4 * kv_cache_len(cfg, cpu) * cfg.kv_elements_per_token * itemsize(cpu)
    assert activation_bytes(cfg, cuda) - activation_bytes(cfg, cpu) == (g - 1) * gathered


def test_cuda_activations_count_what_the_decode_graphs_keep(one_gpu):
    """Each batch size 1..B keeps its whole-step graph's fp32 logits and four ``[b, H]`` tensors per
    layer of its attention-block graphs between replays: counted with graphs on, not without."""
    from moe_runtime.assets import default_model_dir
    from moe_runtime.memory_plan import activation_bytes, itemsize

    cfg = read_model_config(default_model_dir())[1]
    on, off = (RuntimeConfig(device="cuda", max_batch_size=8, cuda_graphs=g) for g in (True, False))
    per_row = cfg.vocab_size * 4 + cfg.num_layers * 4 * cfg.hidden_size * itemsize(on)
    assert activation_bytes(cfg, on) - activation_bytes(cfg, off) == 36 * per_row  # 1 + 2 + ... + 8
