"""Every runtime path on CUDA (skipped cleanly without it), against the CPU's oracles.

* Every family at a 2-slot buffer (copy stream, events, pinned host store), with
  ``--expert-compute`` device and auto (misses split between the host's kernels and an emulated
  link): the CPU engine's greedy tokens and fp32 logits within the oracle tests' tolerance, for one
  prompt and a batch of prompts of different lengths. (The CPU engine is the one CI checks against
  transformers at the pinned version; a GPU machine may carry another transformers.)
* A request joining another's decode (a step mixing prefill and decode rows): the CPU's tokens.
* Quantized slot views (fp8, int8, MXFP4) on the device and through the CPU's kernels: the CPU
  run's greedy tokens in the same format, logits within 1e-3.
* The paged KV cache with blocks of 4 (gathered) and 16 (read in place by the decode kernel):
  preemption by recompute gives a roomy pool's tokens (greedy and seeded sampling), prefix-cache
  hits give an uncached run's; GQA, latent attention and sliding windows with sinks.
* bf16, every expert resident (device-routed experts) against a 2-slot buffer (grouped GEMMs over
  the slot views): the same greedy tokens.
* Decode steps replayed from CUDA graphs (``moe_runtime.engine.decode_graphs``) against eager
  steps (``--enforce-eager``): the same logits bit for bit, a graph per batch size, the buffer's
  counters the same; with offloaded experts, each layer's attention block from a graph
  (``moe_runtime.layers.attention_graphs``) against the eager blocks. These run first: the
  newest paths.
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid_families import BUILDERS, FAMILIES, MODES, NEW, PROMPTS
from test_kv_engine import PARAMS, _run, _same, paged_checkpoints
from test_kv_engine import PROMPTS as KV_PROMPTS
from test_runtime_oracle import _run_collecting_logits, assert_matches, join_mid_decode

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
# device, and auto over a slow emulated link (most misses on the CPU, some copied): the GPU check's
# time does not take all three modes for every family
CUDA_MODES = {mode: MODES[mode] for mode in ("device", "auto")}


@pytest.fixture(scope="module", autouse=True)
def _flex_compiles_per_shape():
    """Every engine here has its own pool and batch shape, and FlexAttention compiles once per
    shape (``dynamic=False``); past Dynamo's recompile limit (8) it would fall back to its unfused
    eager form, which these tests are not about. A serving process compiles one or two shapes."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo, name)
    setattr(dynamo, name, 128)
    yield
    setattr(dynamo, name, before)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return {**tiny_checkpoints, **{name: build(root / name) for name, build in BUILDERS.items()}}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_cuda_decode_graphs_match_eager_steps(checkpoints, family):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (10, 6, 3)]
    got, stats = {}, {}
    for graphs in (True, False):
        rt = RuntimeConfig(
            device="cuda", dtype="bf16", max_model_len=64, max_batch_size=3, cuda_graphs=graphs
        )
        with LLMEngine.from_pretrained(checkpoints[family], rt) as engine:
            for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
                engine.add_request(f"r{i}", prompt, p)
            rows = []
            while engine.has_unfinished():
                outs = engine.step()
                rows.append(([o.new_token_ids for o in outs], engine.last_logits.cpu()))
            got[graphs] = rows
            stats[graphs] = (engine.buffer.stats.lookups, engine.buffer.stats.hits)
            if graphs:
                assert engine.graphs is not None and engine.graphs.enabled, engine.summary()
                assert sorted(engine.graphs.graphs) == [1, 2, 3] and engine.graphs.replays == 9
    assert stats[True] == stats[False]
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got[True], got[False]):
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("compute", ["device", "cpu"])
def test_cuda_attention_graphs_match_eager_blocks(checkpoints, family, compute):
    """Offloaded experts (2 slots), copied or computed on the CPU: each layer's attention block
    replayed from a graph gives the eager blocks' logits bit for bit."""
    got = {}
    for graphs in (True, False):
        rt = RuntimeConfig(
            device="cuda", dtype="bf16", buffer_slots=2, max_model_len=64, max_batch_size=3,
            expert_compute=compute, cuda_graphs=graphs,
        )  # fmt: skip
        with LLMEngine.from_pretrained(checkpoints[family], rt) as engine:
            got[graphs] = _run_collecting_logits(engine, PROMPTS, GREEDY)
            if graphs:
                seg = engine.model.segments
                assert seg is not None and seg.enabled and seg.replays > 0, engine.summary()
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got[True], got[False]):
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("slots", [None, 2], ids=["resident", "offloaded"])
def test_cuda_graphs_captured_at_start(checkpoints, slots):
    """``capture_graphs`` before the first request (``moeserve serve``): the requests capture
    nothing more and give the eager steps' logits bit for bit."""
    got = {}
    for graphs in (True, False):
        rt = RuntimeConfig(
            device="cuda",
            dtype="bf16",
            buffer_slots=slots,
            max_model_len=64,
            max_batch_size=3,
            cuda_graphs=graphs,
        )
        with LLMEngine.from_pretrained(checkpoints["qwen3_moe"], rt) as engine:
            if graphs:
                n, seconds = engine.capture_graphs()
                counts = (len(engine.graphs.graphs), len(engine.model.segments.graphs))
                assert n == sum(counts) > 0, engine.summary()
            got[graphs] = _run_collecting_logits(engine, PROMPTS, GREEDY)
            if graphs:
                assert (len(engine.graphs.graphs), len(engine.model.segments.graphs)) == counts
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got[True], got[False]):
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_families_match_the_cpu_in_every_mode(checkpoints, family):
    path = checkpoints[family]
    cpu_rt = RuntimeConfig(buffer_slots=2, max_model_len=64, max_batch_size=3)
    with LLMEngine.from_pretrained(path, cpu_rt) as engine:
        refs = _run_collecting_logits(engine, PROMPTS[:1], GREEDY) + _run_collecting_logits(
            engine, PROMPTS, GREEDY
        )
    got = {}
    for mode, link in CUDA_MODES.items():
        rt = RuntimeConfig(
            device="cuda",
            buffer_slots=2,
            max_model_len=64,
            max_batch_size=3,
            expert_compute=mode,
            link_gbps=link,
        )
        with LLMEngine.from_pretrained(path, rt) as engine:
            got[mode] = _run_collecting_logits(engine, PROMPTS[:1], GREEDY) + _run_collecting_logits(
                engine, PROMPTS, GREEDY
            )
            st = engine.buffer.stats
            assert engine.loaded.store.data.is_pinned()  # registered at its size (moe_runtime.pinned)
        assert (sum(st.cpu_experts) > 0) == (mode != "device"), mode
        if mode == "device":
            assert st.copies > 0 and 0 < st.copy_s / st.copies < 1.0
        assert_matches([(t, logits.cpu()) for t, logits in got[mode]], refs)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "v3"])
def test_cuda_mixed_prefill_and_decode_step(checkpoints, family):
    tokens = {}
    for device in ("cpu", "cuda"):
        rt = RuntimeConfig(device=device, buffer_slots=2, max_model_len=64, max_batch_size=2)
        with LLMEngine.from_pretrained(checkpoints[family], rt) as engine:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            tokens[device] = join_mid_decode(engine, PROMPTS[0], PROMPTS[2], params)
    assert tokens["cuda"] == tokens["cpu"]


@pytest.mark.parametrize("expert_dtype", ["fp8", "int8", "mxfp4"])
@pytest.mark.parametrize("compute", ["device", "cpu"])
def test_cuda_quantized_experts_match_the_cpu(checkpoints, expert_dtype, compute):
    got = {}
    for device in ("cpu", "cuda"):
        rt = RuntimeConfig(
            device=device,
            buffer_slots=2,
            max_model_len=64,
            max_batch_size=3,
            expert_dtype=expert_dtype,
            expert_compute=compute if device == "cuda" else "device",
        )
        with LLMEngine.from_pretrained(checkpoints["qwen3_moe"], rt) as engine:
            got[device] = _run_collecting_logits(engine, PROMPTS, GREEDY)
    for (tokens, logits), (cpu_tokens, cpu_logits) in zip(got["cuda"], got["cpu"]):
        assert tokens == cpu_tokens
        torch.testing.assert_close(logits.cpu(), cpu_logits, rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def kv_checkpoints(tiny_checkpoints, tmp_path_factory):
    return paged_checkpoints(tiny_checkpoints, tmp_path_factory.mktemp("cuda_kv"))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek", "gpt_oss"], ids=["gqa", "mla", "sliding"])
def test_cuda_paged_kv_preemption_and_prefix_hits(kv_checkpoints, family, block_size):
    path = kv_checkpoints[family]
    base = dict(
        device="cuda",
        max_model_len=64,
        max_batch_size=4,
        block_size=block_size,
        buffer_slots=2,
        max_num_batched_tokens=16,
    )
    roomy, _, _ = _run(path, RuntimeConfig(**base), KV_PROMPTS, PARAMS)
    blocks = {4: 16, 16: 6}[block_size] * (2 if family == "gpt_oss" else 1)
    tight, _, stats = _run(path, RuntimeConfig(num_kv_blocks=blocks, **base), KV_PROMPTS, PARAMS)
    assert stats.preemptions >= 1
    _same(tight, roomy)
    cpu, _, _ = _run(path, RuntimeConfig(**{**base, "device": "cpu"}), KV_PROMPTS[:1], PARAMS[:1])
    assert cpu["r0"][0] == roomy["r0"][0]  # greedy: the CPU's tokens (seeded sampling differs by device)

    shared = [(5 * i) % 300 + 1 for i in range(2 * block_size + 1)]  # two whole blocks and one
    prompts = [shared + [5 + i, 9, 2 * i + 1] for i in range(3)]
    params = [PARAMS[0], PARAMS[1], PARAMS[0]]
    off, _, _ = _run(path, RuntimeConfig(enable_prefix_caching=False, **base), prompts, params, True)
    on, cached, _ = _run(path, RuntimeConfig(**base), prompts, params, True)
    assert cached == {"r0": 0, "r1": 2 * block_size, "r2": 2 * block_size}
    _same(on, off)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cuda_bf16_resident_experts_match_the_slot_path(checkpoints, family):
    tokens = {}
    for slots in (None, 2):
        rt = RuntimeConfig(
            device="cuda", dtype="bf16", buffer_slots=slots, max_model_len=64, max_batch_size=3
        )
        with LLMEngine.from_pretrained(checkpoints[family], rt) as engine:
            assert engine.buffer.all_resident == (slots is None)
            tokens[slots] = [t for t, _ in _run_collecting_logits(engine, PROMPTS, GREEDY)]
    assert tokens[None] == tokens[2]
