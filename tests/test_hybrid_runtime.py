"""Hybrid expert execution in the runtime (``moe_runtime.hybrid``) on the bundled model.

``--expert-compute cpu`` and ``auto`` give ``device``'s logits bit for bit on this CPU (fp32); ``cpu``
copies nothing after load and holds the documented fixed set; ``auto`` over an emulated link
places misses on the CPU and keeps its prediction beside the measured layer time; the compute
thread makes one host sync per MoE layer whatever runs on the CPU; placement sorts resident, in
flight and missed experts from the slot states; the per-request figures, the Prometheus counters,
``usage`` and the load summary carry the CPU figures; the prefetch gate's ``b`` is capped by the
CPU's time per miss."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_op_counts import _Count, _CountSync

import moe_runtime.model as model_mod
from moe_runtime.assets import default_model_dir
from moe_runtime.buffer import ExpertBuffer
from moe_runtime.buffer.slots import LOADING
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import ExpertRequestStats, RequestOutput, SamplingParams
from moe_runtime.errors import ConfigError
from moe_runtime.hybrid.cost_model import LinearCost
from moe_runtime.hybrid.executor import CPUExpertExecutor
from moe_runtime.hybrid.kernel_choice import choose_kernels
from moe_runtime.hybrid.placement import HybridPlacer
from moe_runtime.hybrid.setup import default_threads
from moe_runtime.io.transfer_queue import Transfer
from moe_runtime.store import HostExpertStore

PROMPTS = [[5, 17, 33, 2], [9, 1, 44, 8, 120]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _logits(runtime: RuntimeConfig) -> tuple[list[torch.Tensor], LLMEngine]:
    """Each step's logits of PROMPTS decoded together, and the (closed) engine."""
    rows = []
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, PARAMS)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
            rows.append(engine.last_logits.clone())
        engine.outs = outs
    return rows, engine


def _rt(**kw) -> RuntimeConfig:
    return RuntimeConfig(max_model_len=64, max_batch_size=2, buffer_slots=16, **kw)


@pytest.fixture(scope="module")
def device_logits():
    return _logits(_rt(expert_compute="device"))[0]


def test_cpu_mode_equals_device_bit_for_bit_and_copies_nothing(device_logits):
    got, engine = _logits(_rt(expert_compute="cpu"))
    assert all(torch.equal(a, b) for a, b in zip(got, device_logits))
    st = engine.buffer.stats
    assert st.demand_bytes == 0 and st.prefetch_bytes == 0 and st.copies == 0
    cpu = sum(st.cpu_experts)
    assert cpu > 0 and cpu == st.total_lookups - st.total_hits
    assert st.cpu_avoided_bytes == cpu * engine.loaded.store.expert_nbytes and st.cpu_expert_s > 0
    # the fixed set: the last 16 experts in layer order (llama.cpp --n-cpu-moe's layers)
    total = engine.config.num_moe_layers * engine.config.num_experts
    assert sorted(engine.buffer.parts[0].key_slot) == list(range(total - 16, total))
    assert type(engine.prefetcher).__name__ == "PrefetchPolicy"  # on-demand: nothing to prefetch
    # per request: the CPU lookups its tokens made, and the bytes they did not move
    charged = sum(o.expert_stats.cpu_experts for o in engine.outs if o.finished)
    assert charged >= cpu
    for o in engine.outs:
        if o.finished:
            es = o.expert_stats
            assert es.bytes_not_moved == es.cpu_experts * engine.loaded.store.expert_nbytes and es.cpu_s > 0


def test_auto_over_a_slow_link_places_misses_on_the_cpu_with_the_same_bits(device_logits):
    got, engine = _logits(_rt(expert_compute="auto", link_gbps=0.05, prefetch_policy="on-demand"))
    assert all(torch.equal(a, b) for a, b in zip(got, device_logits))
    st, placer = engine.buffer.stats, engine.hybrid
    assert sum(st.cpu_experts) > 0
    assert st.total_lookups == sum(st.device_lookups)
    assert placer.records and placer.prediction_error() is not None
    rec = placer.records[-1]
    assert rec.predicted_s > 0 and rec.measured_s > 0
    assert rec.resident + rec.inflight + rec.cpu + rec.copied > 0


@pytest.mark.parametrize(
    ("dtype", "expert_dtype"), [("fp32", "int8"), ("fp32", "fp8"), ("fp32", "mxfp4"), ("bf16", "auto")]
)
def test_cpu_mode_with_a_gemv_kernel_is_close_to_device(monkeypatch, dtype, expert_dtype):
    """The compiled kernels in the engine (forced: the tiny experts may measure faster with torch's):
    int8, fp8 and MXFP4 experts under fp32, and a bf16 model's experts (the hidden activation rounded
    as the device path rounds it), give device's tokens with logits within rounding."""
    import moe_runtime.hybrid.setup as setup

    eligible = setup.eligible_kernels
    monkeypatch.setattr(
        setup, "eligible_kernels", lambda store: [k for k in eligible(store) if "gemv" in k.name]
    )
    want, _ = _logits(_rt(expert_compute="device", dtype=dtype, expert_dtype=expert_dtype))
    got, engine = _logits(_rt(expert_compute="cpu", dtype=dtype, expert_dtype=expert_dtype))
    assert "gemv" in engine.summary() and sum(engine.buffer.stats.cpu_experts) > 0
    tol = {"rtol": 0.02, "atol": 0.05} if dtype == "bf16" else {"rtol": 1e-4, "atol": 1e-4}
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_auto_is_the_default_over_a_link_and_device_without():
    assert RuntimeConfig().expert_compute_mode == "device"
    assert RuntimeConfig(link_gbps=1.0).expert_compute_mode == "auto"
    assert RuntimeConfig(link_gbps=1.0, expert_compute="device").expert_compute_mode == "device"
    with pytest.raises(ConfigError, match="--expert-compute"):
        RuntimeConfig(expert_compute="gpu")
    with pytest.raises(ConfigError, match="--cpu-expert-threads"):
        RuntimeConfig(cpu_expert_threads=0)
    assert default_threads(1, 1) >= 1


def test_summary_names_the_mode_kernel_and_gbps():
    with LLMEngine.from_pretrained(default_model_dir(), _rt(expert_compute="cpu", cpu_expert_threads=2)) as e:
        s = e.summary()
    assert "expert compute cpu: 2 CPU expert threads, kernel linear (" in s and "GB/s at 1 row" in s
    assert "(CPU device, no link: the modes compute alike)" in s and s.endswith("experts run grouped")
    with LLMEngine.from_pretrained(default_model_dir(), RuntimeConfig(max_model_len=32)) as e:
        assert "expert compute device (CPU device, no link: the modes compute alike)" in e.summary()


@pytest.mark.parametrize("batch", [1, 2])
def test_one_host_sync_per_moe_layer_with_cpu_experts(monkeypatch, batch):
    """The CPU path adds no host sync on the compute thread (the CPU proxy for the device
    stream): one per MoE layer, the router ids, whatever runs on the CPU; its ops there stay
    within the device path's bound (60 per MoE layer at batch 1)."""
    counts = []
    moe_block = model_mod.moe_block

    def counted(x, *args, **kwargs):
        if x.shape[0] != batch:
            return moe_block(x, *args, **kwargs)
        with _CountSync() as fs, _Count() as ds:
            out = moe_block(x, *args, **kwargs)
        counts.append((ds.ops, fs.syncs + ds.syncs))
        return out

    monkeypatch.setattr(model_mod, "moe_block", counted)
    rt = RuntimeConfig(max_model_len=64, max_batch_size=batch, buffer_slots=8, expert_compute="cpu")
    with LLMEngine.from_pretrained(default_model_dir(), rt) as engine:
        engine.generate([[5 + i, 17, 33, 2] for i in range(batch)], PARAMS)
        assert sum(engine.buffer.stats.cpu_experts) > 0
    assert counts and all(s == 1 for _, s in counts)
    if batch == 1:
        assert sum(o for o, _ in counts) / len(counts) <= 60


def _placer_buffer():
    """A 4-slot buffer with a link over one layer of 8 experts and a placer on it."""
    store = HostExpertStore(1, 8, 16, 8, torch.float32)
    store.data.normal_()
    buf = ExpertBuffer(store, [torch.device("cpu")], 4, "lru", link=(1.0, 0.0))
    ex = CPUExpertExecutor(store, choose_kernels(store, (1,), repeats=1), 1)
    cheap, dear = LinearCost(1e-6, 0.0), LinearCost(1.0, 0.0)
    placer = HybridPlacer(buf, "auto", ex, cheap, dear, False, [1e-3])
    buf.placer = placer
    return buf, placer


def test_placement_sorts_resident_in_flight_and_missed_experts():
    """Resident (READY) and in-flight (LOADING) experts are looked up as before; a missed one
    (queued prefetch or absent) goes where the model says, here the CPU, whose queued prefetch
    is cancelled; lookups are counted once each."""
    buf, placer = _placer_buffer()
    try:
        part = buf.parts[0]
        with buf.cond:
            part.preload([0])  # resident
            s = part.allocate(Transfer(1, False))  # in flight
            assert part.state[s] == LOADING and part.loading == 1
            part.queue.push(Transfer(2, False, 1.0))  # a queued prefetch of a miss
            counts = np.array([1, 1, 1, 2, 0, 0, 0, 0])
            experts, keys, cpu, predicted = placer.split(0, [0, 1, 2, 3], [0, 1, 2, 3], counts)
        assert experts == [0, 1] and cpu.experts == [2, 3] and predicted > 0
        assert part.queue.queued(2) is None and buf.stats.prefetch_cancelled == 1
        assert buf.stats.cpu_experts[0] == 2 and buf.stats.lookups[0] == 2  # the rest at lookup
    finally:
        placer.close()
        buf.close()


def test_cpu_miss_seconds_reach_the_prefetch_gate():
    rt = _rt(expert_compute="auto", link_gbps=0.05)
    with LLMEngine.from_pretrained(default_model_dir(), rt) as engine:
        engine.generate(PROMPTS, PARAMS)
        assert engine.buffer.cpu_miss_seconds is not None and engine.buffer.cpu_miss_seconds > 0
        assert engine.prefetcher.gate.cpu_miss_s is not None and engine.prefetcher.gate.cpu_miss_s > 0
        # the CPU lane's start delay (submit to first unit) is measured and reaches the placement
        assert engine.buffer.placer.cpu_start_s > 0


def test_metrics_and_usage_carry_the_cpu_figures():
    from server.metrics import RuntimeCollector
    from server.routes.common import usage

    with LLMEngine.from_pretrained(default_model_dir(), _rt(expert_compute="cpu")) as engine:
        outs = engine.generate(PROMPTS, PARAMS)
        st = engine.buffer.stats
        fams = {f.name: f for f in RuntimeCollector(SimpleNamespace(engine=engine))._expert_metrics()}
    value = {f: {tuple(s.labels.values()): s.value for s in fams[f].samples} for f in fams}
    assert sum(value["moeserve_expert_cpu_runs"].values()) == sum(st.cpu_experts) > 0
    assert value["moeserve_expert_cpu_seconds"][()] == st.cpu_expert_s > 0
    assert value["moeserve_expert_cpu_wait_seconds"][()] == st.cpu_wait_s
    assert value["moeserve_expert_transfer_avoided_bytes"][()] == st.cpu_avoided_bytes > 0
    u = usage([4, 5], outs).expert_stats
    assert u.cpu_experts == sum(o.expert_stats.cpu_experts for o in outs) > 0
    assert u.bytes_not_moved == sum(o.expert_stats.bytes_not_moved for o in outs)
    assert math.isclose(u.cpu_expert_ms, round(1e3 * sum(o.expert_stats.cpu_s for o in outs), 3))
    plain = RequestOutput(
        "x", [], "", "", True, "stop", 1, 1, [], None, ExpertRequestStats(), 0.0, None, None
    )
    assert usage([1], [plain]).expert_stats.cpu_experts == 0


@pytest.mark.parametrize(
    "prefetch,cache",
    [("on-demand", "lru"), ("next-layer-all", "lru"), ("model-counts", "model-counts"),
     ("hot-experts", "lru"), ("eam", "eam"), ("eam", "eam-reuse")],
)  # fmt: skip
def test_auto_runs_with_every_policy_and_keeps_the_bits(device_logits, prefetch, cache):
    """The baselines and the eam policies run beside hybrid placement (a link slow enough that
    some misses go to the CPU, fast enough that some are copied): the same logits as device."""
    rt = _rt(expert_compute="auto", link_gbps=0.5, prefetch_policy=prefetch, cache_policy=cache)
    got, engine = _logits(rt)
    assert all(torch.equal(a, b) for a, b in zip(got, device_logits))
    assert sum(engine.buffer.stats.cpu_experts) > 0
