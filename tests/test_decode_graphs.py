"""Decode steps from graphs (``moe_runtime.engine.decode_graphs``), on the CPU with the stand-in
that re-runs the captured forward on the graph's static inputs: what the CUDA graphs' bookkeeping
must get right (inputs refreshed every step, one graph per batch size, the host's per-step work on
the step's own requests) shows here as tokens, logits and buffer counters.

The GPU's choices are set on the CPU: the device-routed resident experts and FlexAttention decode
over the blocks (eager here, compiled on CUDA). Against that same eager path the graphs give the
same logits bit for bit, over a batch that shrinks as requests finish (batch sizes 3, 2, 1),
prefix-cache hits, and gpt-oss's sliding windows and sinks; and a graph whose positions are not
refreshed gives other tokens (the check has teeth)."""

from __future__ import annotations

import pytest
import torch
from test_runtime_oracle import _run_collecting_logits
from tiny_models import make_gpt_oss_checkpoint

import moe_runtime.layers.resident_experts as resident
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.decode_graphs import DecodeGraphs
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.layers.attention_graphs import AttentionGraphs
from moe_runtime.layers.kv_cache import cdiv
from moe_runtime.layers.paged_decode import FlexPagedDecode

MAX_LEN = 64
PROMPTS = [[5, 17, 33, 2, 250, 7, 91, 12], [9, 1, 44], [100, 101, 102, 103, 104, 105]]
# different lengths: the batch shrinks from 3 to 1 as requests finish
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (10, 6, 3)]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    gpt_oss = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("graphs") / "gpt_oss")
    return {"qwen3_moe": tiny_checkpoints["qwen3_moe"], "gpt_oss": gpt_oss}


def _engine(path, monkeypatch, graphs: bool, segments: bool = False, **kw) -> LLMEngine:
    """An engine on the GPU's decode path (device-routed experts, FlexAttention over the blocks),
    with the CPU stand-in of the whole-step graphs when ``graphs``, of the attention blocks' graphs
    (``moe_runtime.layers.attention_graphs``) when ``segments``."""
    monkeypatch.setitem(resident.DEVICE_ROUTED, "cpu", True)
    runtime = RuntimeConfig(max_model_len=MAX_LEN, max_batch_size=3, **kw)
    engine = LLMEngine.from_pretrained(path, runtime)
    kv = engine.kv
    kv.flex = FlexPagedDecode(
        kv.num_blocks,
        kv.block_size,
        3,
        cdiv(MAX_LEN, kv.block_size),
        len(kv.windows),
        kv._kv.device,
        compiled=False,
    )
    if graphs:
        engine.graphs = DecodeGraphs(engine.model, kv, emulate=True)
    if segments:
        engine.model.segments = AttentionGraphs(engine.model, kv, emulate=True)
    return engine


def _run(engine: LLMEngine, prompts=PROMPTS, params=PARAMS):
    """Per request: (tokens, step logits), as ``_run_collecting_logits`` with per-request params."""
    rows: dict[str, list[torch.Tensor]] = {}
    finals = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
        rows[f"r{i}"] = []
    while engine.has_unfinished():
        outs = engine.step()
        for row, out in zip(engine.last_logits, outs):
            rows[out.request_id].append(row)
            if out.finished:
                finals[out.request_id] = out.output_token_ids
    return [(finals[r], torch.stack(rows[r])) for r in rows]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_graphs_give_the_eager_steps_logits(checkpoints, monkeypatch, family):
    got = {}
    for graphs in (False, True):
        with _engine(checkpoints[family], monkeypatch, graphs) as engine:
            got[graphs] = _run(engine)
            stats = engine.buffer.stats
            got[graphs, "stats"] = (stats.lookups, stats.hits, list(stats.device_lookups))
            if graphs:
                assert sorted(engine.graphs.graphs) == [1, 2, 3]  # one per batch size seen
                replays = engine.graphs.replays
    decode_steps = max(p.max_tokens for p in PARAMS) - 1  # every step after the prefill decodes
    assert replays == decode_steps
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got[True], got[False]):
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert got[True, "stats"] == got[False, "stats"]  # the host's per-step work ran for every layer


def test_graphs_match_the_plain_cpu_path(checkpoints, monkeypatch):
    """Against the engine with none of the GPU's choices (gathered attention, host-planned
    experts): the same greedy tokens."""
    with LLMEngine.from_pretrained(
        checkpoints["qwen3_moe"], RuntimeConfig(max_model_len=MAX_LEN, max_batch_size=3)
    ) as e:
        plain = [t for t, _ in _run(e)]
    with _engine(checkpoints["qwen3_moe"], monkeypatch, True) as engine:
        assert [t for t, _ in _run(engine)] == plain


def test_prefix_hits_replay_the_same_graph(checkpoints, monkeypatch):
    """Requests sharing a 33-token prefix, one after another: the later ones hit the cache and
    decode from the batch-1 graph with the uncached run's tokens."""
    shared = [(5 * i) % 300 + 1 for i in range(33)]
    prompts = [shared + [5 + i, 9] for i in range(3)]
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    tokens = {}
    for caching in (False, True):
        with _engine(checkpoints["qwen3_moe"], monkeypatch, True, enable_prefix_caching=caching) as engine:
            tokens[caching] = [_run(engine, [p], params)[0][0] for p in prompts]
            assert sorted(engine.graphs.graphs) == [1]
            hits = engine.stats.prefix_cache_hits
    assert hits == 64 and tokens[True] == tokens[False]


def test_a_stale_input_shows(checkpoints, monkeypatch):
    """The check has teeth: a graph whose positions are not refreshed per step (its rotary angles
    stay the capture step's) gives other logits."""
    load = DecodeGraphs._load

    def stale(self, input_ids, step, g):
        positions = step.positions
        step.positions = g.step.positions.clone()
        try:
            load(self, input_ids, step, g)
        finally:
            step.positions = positions

    with _engine(checkpoints["qwen3_moe"], monkeypatch, False) as engine:
        ref = _run(engine)
    monkeypatch.setattr(DecodeGraphs, "_load", stale)
    with _engine(checkpoints["qwen3_moe"], monkeypatch, True) as engine:
        got = _run(engine)
    assert not torch.equal(got[0][1], ref[0][1])


def test_offloaded_and_prefill_steps_run_eagerly(checkpoints, monkeypatch):
    """Experts offloaded (a host decision per layer): no graph; tokens as without graphs."""
    with _engine(checkpoints["qwen3_moe"], monkeypatch, True, buffer_fraction=0.5) as engine:
        tokens = [t for t, _ in _run(engine)]
        assert engine.graphs.graphs == {} and engine.graphs.replays == 0
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, buffer_fraction=0.5) as engine:
        assert [t for t, _ in _run(engine)] == tokens


def test_collecting_helper_still_sees_every_row(checkpoints, monkeypatch):
    """``last_logits`` is the step's own copy: rows kept across steps are not overwritten by the
    next replay."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with _engine(checkpoints["qwen3_moe"], monkeypatch, True) as engine:
        ((tokens, logits),) = _run_collecting_logits(engine, PROMPTS[:1], params)
    assert logits.shape[0] == 6 and not torch.equal(logits[-1], logits[-2])
