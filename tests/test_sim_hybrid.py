"""Simulator: hybrid expert execution (``--expert-compute``) with the runtime's own placement
(``moe_runtime.hybrid.cost_model.place_layer``), the hybrid bound and the placement counts."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import moeserve.sim.hybrid as sim_hybrid
from moe_runtime.hybrid.cost_model import place_layer
from moe_runtime.hybrid.executor import split_ranges
from moeserve.sim.buffer import SimBuffer
from moeserve.sim.cost import CostModel
from moeserve.sim.engine import SimConfig, Simulator
from moeserve.sim.hardware import get_hardware
from moeserve.sim.hybrid import CPUCost, HybridConfig, SimPlacer, StepTally
from moeserve.sim.models import get_model
from moeserve.sim.runner import SIM_COMBOS, run_combos, run_modes
from moeserve.sim.speed import synthetic_workload
from moeserve.sim.workload import SimRequest, split_requests, split_warm_eval, with_prompts


def mixtral_sim(hw: str = "a5000", slots: int = 57, batch: int = 1, mode: str = "device", threads=None):
    """A Mixtral-8x7B profile on ``hw`` with the host pool's roofline CPU cost and the hybrid bound."""
    m, h = get_model("mixtral-8x7b"), get_hardware(hw)
    cost = CostModel.roofline(m, h)
    n = threads or h.host.default_threads()
    hy = HybridConfig(
        mode, n, CPUCost.pool(m, h.host, n),
        m.expert_bytes / ((h.link.gbps + h.host.pool_gbps(n)) * 1e9), cost.expert_bytes_s,
    )  # fmt: skip
    return Simulator(32, 8, 2, m.expert_bytes, cost, SimConfig(slots=slots, batch=batch, hybrid=hy))


@pytest.fixture(scope="module")
def mixtral_like():
    wl = synthetic_workload(32, 8, 2, 8, 12, seed=3)
    return split_warm_eval(wl, 1)


def fingerprint(run) -> tuple:
    return (dict(run.stats), run.tpot_s, run.sim_seconds, run.steps)


def test_device_mode_is_the_fetch_only_run(mixtral_like) -> None:
    warm, evals = mixtral_like
    hybrid = mixtral_sim(mode="device")
    plain = Simulator(hybrid.L, hybrid.E, hybrid.k, hybrid.expert_bytes, hybrid.cost,
                      replace(hybrid.config, hybrid=None))  # fmt: skip
    a = run_combos(plain, SIM_COMBOS, warm, evals)
    b = run_modes(hybrid, SIM_COMBOS, ["device"], warm, evals)
    assert [fingerprint(r) for r in a] == [fingerprint(r) for r in b]
    assert all(r.hybrid is None for r in a)
    assert all(r.hybrid["mode"] == "device" and r.hybrid["decode"]["cpu"] == 0 for r in b)


def test_placement_is_deterministic(mixtral_like) -> None:
    warm, evals = mixtral_like
    sim = mixtral_sim(batch=4, threads=1)
    runs = [run_modes(sim, [("eam", "eam", "eam-reuse")], ["auto", "cpu"], warm, evals) for _ in range(2)]
    assert [(fingerprint(r), r.hybrid) for r in runs[0]] == [(fingerprint(r), r.hybrid) for r in runs[1]]
    auto, cpu = runs[0]
    assert auto.label == "eam (auto)" and cpu.label == "cpu"
    assert auto.hybrid["decode"]["cpu"] > 0 and auto.hybrid["cpu_avoided_bytes"] > 0


def test_placement_calls_the_runtime_cost_model(monkeypatch, mixtral_like) -> None:
    warm, evals = mixtral_like
    seen = []

    def spy(costs, cpu, device, mode="auto"):
        seen.append((costs, mode))
        return place_layer(costs, cpu, device, mode)

    monkeypatch.setattr(sim_hybrid, "place_layer", spy)
    sim = mixtral_sim(mode="auto", threads=3)
    sim.run("eam", "eam-reuse", warm, evals)
    assert seen and all(mode == "auto" and c.cpu_lanes == 1 for c, mode in seen)  # the pool: one lane
    t = sim.cost.transfer_s
    for c, _ in seen:  # the runtime's inputs: one copy's time, the copies in flight times it
        assert c.link_s == [t] and len(c.miss_rows) == len(c.miss_part) > 0
        assert len(c.link_backlog_s) == 1 and c.link_backlog_s[0] / t == round(c.link_backlog_s[0] / t)


def test_pool_cost_is_the_sockets_bandwidth_capped_by_its_cores_and_sustained_flops() -> None:
    """The runtime's pool on one Mixtral expert: at the default threads it reads at the socket's
    sustained rate (the ranges' stagger hidden under it), a one-thread pool at one core's; 128
    rows at the sustained FLOP/s of the pool's cores plus the stagger of the ranges."""
    from moeserve.sim.hardware import CORE_READ_GBPS, GEMM_EFFICIENCY

    m = get_model("mixtral-8x7b")
    for hw in ("a5000", "h100"):
        host = get_hardware(hw).host
        n = host.default_threads()
        assert host.pool_gbps(n) == host.mem_gbps and host.pool_gbps(1) == CORE_READ_GBPS
        assert host.sustained_flops == pytest.approx(host.peak_flops * GEMM_EFFICIENCY[host.isa])
        c = CPUCost.pool(m, host, n)
        over = host.expert_overhead_us * 1e-6
        # about one 16-row-aligned range per thread in each phase (>= 1 MiB of weights each)
        shapes = ((2 * m.expert_intermediate, m.expert_intermediate), (m.hidden, m.hidden))
        ranges = [len(split_ranges(r, m.expert_bytes // (3 * w), n, 1 << 20)) for r, w in shapes]
        assert all(n - 2 <= r <= n for r in ranges)
        stagger = sum(r - 1 for r in ranges) * host.unit_overhead_us * 1e-6
        read = over + m.expert_bytes / (host.mem_gbps * 1e9)
        assert read - 1e-12 <= c.seconds(1) <= read + stagger
        flops = host.sustained_flops * n / host.cores
        want = over + 128 * m.expert_flops_per_token / flops
        assert want < c.seconds(128) <= over + (want - over) * n / min(ranges) + stagger + 1e-9
        one = CPUCost.pool(m, host, 1)  # one range per phase at one core's read rate
        assert one.seconds(1) == pytest.approx(over + m.expert_bytes / (CORE_READ_GBPS * 1e9))
    assert get_hardware("h100").host.isa == "amx" and get_hardware("a5000").host.isa == "fma"


def test_hand_timed_layer_splits_between_link_and_cpu() -> None:
    # one slot, copies of 10 s, device 1 s per expert, two lanes of 12 s per job: the first miss is
    # copied (ends at 11 < 12), the next two run on the CPU (12 < 21); the layer ends at 12
    buf = SimBuffer(1, 4, 1, 1, 100, 10.0)
    buf.placer = SimPlacer(buf, "auto", 2, CPUCost(12.0, 0.0, 0.0), lambda rows: 1.0, 100)
    run = buf.start_layer(0, [0, 1, 2], np.array([1, 1, 1, 0]))
    blocked = buf.finish_layer(0, run, lambda e: 1.0)
    st = buf.stats
    assert (buf.now, blocked, st.cpu_wait_s) == (12.0, 10.0, 1.0)
    assert (st.cpu_experts[0], st.demand_fetches[0], st.lookups[0], st.cpu_expert_s) == (2, 1, 3, 24.0)
    # cheaper jobs (3 s): every miss on the CPU, lanes [3, 3] then 6
    buf = SimBuffer(1, 4, 1, 1, 100, 10.0)
    buf.placer = SimPlacer(buf, "auto", 2, CPUCost(3.0, 0.0, 0.0), lambda rows: 1.0, 100)
    buf.finish_layer(0, buf.start_layer(0, [0, 1, 2], np.array([1, 1, 1, 0])), lambda e: 1.0)
    assert (buf.now, buf.stats.cpu_experts[0], buf.stats.demand_fetches[0]) == (6.0, 3, 0)


def test_cpu_mode_copies_nothing_and_holds_the_last_experts(mixtral_like) -> None:
    warm, evals = mixtral_like
    sim = mixtral_sim(mode="cpu", slots=20)
    state = sim.make_state("eam", "eam-reuse")
    part = state.buffer.parts[0]
    assert sorted(part.key_slot) == list(range(256 - 20, 256))
    assert type(state.prefetcher).name == "on-demand" and type(part.policy).name == "lru"
    run = sim.run("eam", "eam-reuse", warm, evals)
    assert run.stats["demand_bytes"] == run.stats["prefetch_bytes"] == 0
    d = run.hybrid["decode"]
    assert d["copied"] == 0 and d["cpu"] + d["resident"] == pytest.approx(run.lookups / d["steps"])


def test_bound_is_below_every_row_and_adds_up() -> None:
    t = StepTally(2.0, 0.5)
    t.step(False, 4, 1, 2, 0.25, first=True)  # a group's first step: counted, not in the bound
    t.step(False, 4, 1, 2, 0.25, first=False)
    t.step(False, 2, 2, 0, 0.25, first=False)
    t.end_group()
    out = t.summary()
    assert out["bound_s"] == pytest.approx(((0.25 + 3 * 2.0 + 0.5) + (0.25 + 1.0)) / 2)
    assert out["decode"] == {"steps": 3, "cpu": 4 / 3, "copied": 2 / 3, "resident": 4 / 3}
    wl = synthetic_workload(32, 8, 2, 6, 10, seed=1)
    warm, evals = split_warm_eval(wl, 1)
    for mode in ("device", "cpu", "auto"):
        for run in run_modes(
            mixtral_sim(batch=2, threads=1), [("eam", "eam", "eam-reuse")], [mode], warm, evals
        ):
            assert 0 < run.hybrid["bound_s"] < run.tpot_s


def test_prefill_chunks_meet_the_device_decode_steps_the_cpu_on_a5000(mixtral_like) -> None:
    """A 512-token chunk's experts (~128 rows each) take about a copy's time on the pool at its
    sustained FLOP/s, so the split sends most of them to the device (resident or copied) and about
    half its misses over the link; a decode step's one-row misses go to the CPU."""
    warm, evals = mixtral_like
    sim = mixtral_sim(mode="auto")  # the host's default threads
    run = run_modes(sim, [("eam", "eam", "eam-reuse")], ["auto"], warm, evals[:2], 512, warm + evals)[0]
    p, d = run.hybrid["prefill"], run.hybrid["decode"]
    assert p["steps"] >= 1 and p["cpu"] < p["copied"] + p["resident"]
    assert p["cpu"] < 0.6 * (p["cpu"] + p["copied"]) and d["cpu"] > 0.8 * (d["cpu"] + d["copied"])


def test_split_and_prompts() -> None:
    ids = np.arange(30 * 2 * 1).reshape(30, 2, 1)
    reqs = [SimRequest("a", "t", ids[:10], ids[:10].astype(np.float32), 2),
            SimRequest("b", "t", ids[10:], ids[10:].astype(np.float32), 0)]  # fmt: skip
    parts = split_requests(reqs, 5)
    assert len(parts) == 5 and sum(p.num_rows for p in parts) == 30
    assert parts[0].num_prefill == 2 and all(p.num_prefill == 0 for p in parts[1:])
    assert np.array_equal(np.concatenate([p.ids for p in parts]), ids)
    assert split_requests(reqs, 2) == reqs
    prompted = with_prompts(reqs, 4, reqs)
    assert [p.num_prefill for p in prompted] == [6, 4]
    assert np.array_equal(prompted[1].ids[:4], ids[4:8]) and np.array_equal(prompted[1].ids[4:], ids[10:])


def test_cli_rows_show_bound_and_placement(tmp_path, capsys) -> None:
    from moeserve.cli import main
    from tracer.trace_file import TraceRecord, TraceWriter

    wl = synthetic_workload(32, 8, 2, 6, 8, seed=2)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        for r in wl.requests:
            w.write(TraceRecord(r.request_id, r.task, None, 32, 8, 2, r.num_prefill, r.ids, r.weights))
    argv = ["simulate", "--trace", str(path), "--policy", "eam,oracle", "--expert-compute",
            "device,cpu,auto", "--buffer-slots", "57", "--batch", "4", "--split-eval", "4",
            "--prefill-tokens", "64", "--json"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in doc["results"]}
    assert list(rows) == ["eam", "oracle", "cpu", "eam (auto)"]
    assert all(r["bound_ms"] is not None and r["bound_ms"] < r["tpot_ms"] for r in rows.values())
    assert rows["cpu"]["placement"]["copied"] == 0 and rows["eam"]["placement"]["cpu"] == 0
    assert (
        rows["eam (auto)"]["prefill_placement"]["steps"] >= 1 and rows["oracle"]["prefill_placement"] is None
    )
    assert doc["settings"]["cpu_threads"] == 30 and doc["settings"]["measured_sequences"] == 4
    assert main(["simulate", "--trace", str(path), "--expert-compute", "gpu"]) == 2
    assert "--expert-compute: 'gpu'" in capsys.readouterr().err
