"""The simulator reproduces the threaded runtime exactly where timing cannot matter.

Without prefetching and with LRU, which experts are resident depends only on the access order,
not on how long copies take (a just-used expert is never LRU's victim while an older one is
evictable, and when a layer streams experts through the slots the first released slot is also the
least recently used one). So the runtime's ``ExpertBuffer`` (real threads, real copies) and the
simulator's ``SimBuffer`` (the same ``Partition`` and cache policy on an event clock) must count
the same lookups, hits and demand fetches on the runtime's own recorded trace. (Count-based cache
policies are not timing-free: whether the I/O thread picks its victim before or after the compute
thread released the layer's first experts changes the candidates, so the threaded runtime itself
varies from run to run; calibration covers them.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_checkpoint

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.loader import load_checkpoint
from moeserve.sim.cost import CostModel
from moeserve.sim.engine import SimConfig, Simulator
from moeserve.sim.workload import load_workload
from tracer.eamc import EAMC
from tracer.recorder import RequestRecorder
from tracer.trace_file import TraceWriter

PROMPTS = [
    [5, 9, 17, 33, 2],
    [40, 41, 42],
    [7, 7, 8, 100, 200, 31, 3],
    [11, 250, 12, 13],
    [90, 91],
    [60, 61, 62],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("simfid") / "mixtral", seed=3, num_layers=3)


def test_runtime_and_simulator_count_the_same(checkpoint: Path, tmp_path: Path) -> None:
    slots, batch, cache = 5, 3, "lru"
    runtime = RuntimeConfig(
        buffer_slots=slots,
        cache_policy=cache,
        prefetch_policy="on-demand",
        max_batch_size=batch,
        cpu_threads=1,
    )
    loaded = load_checkpoint(checkpoint, runtime)
    cfg = loaded.config
    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace)
    recorder = RequestRecorder(
        cfg.num_moe_layers, cfg.num_experts, cfg.top_k, EAMC(cfg.num_moe_layers, cfg.num_experts), writer
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLMEngine(loaded, runtime, recorder=recorder) as engine:
        for i in range(0, len(PROMPTS), batch):
            engine.generate(PROMPTS[i : i + batch], params)
        real = engine.buffer.stats.summary()
    writer.close()

    wl = load_workload(trace)
    assert len(wl.requests) == len(PROMPTS)
    cost = CostModel.measured(
        transfer_s=1e-3, expert_a_s=1e-4, expert_b_s=0.0, layer_fixed_s=1e-4, layer_b_s=0.0, step_fixed_s=0.0
    )
    sim = Simulator(wl.num_layers, wl.num_experts, wl.top_k, 1, cost, SimConfig(slots=slots, batch=batch))
    run = sim.run("on-demand", cache, [], wl.requests)
    for key in ("lookups", "hits", "demand_fetches", "late_prefetches"):
        assert run.stats[key] == real[key], key
