"""One CPU expert split over every pool thread (``moe_runtime.hybrid.executor``): ranges of output
rows, about one per thread, at multiples of ``ROW_ALIGN``; joined, they give the whole product's
bits for every kernel that splits (the device path's for the exact ones); a kernel whose ranges
differ runs whole; several experts share the pool with a barrier each; a failing unit raises in
``finish`` instead of hanging; the engine's ``cpu`` and ``auto`` keep ``device``'s logits with
experts split over three threads; the pool is one lane of the placement."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_hybrid_kernels import E, H, I, device_path, make_store

import moe_runtime.hybrid.executor as executor_mod
import moe_runtime.hybrid.placement as placement_mod
from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.hybrid.cpu_kernels import ROW_ALIGN, Linear, gate_up_pieces, run_projections
from moe_runtime.hybrid.executor import CPUExpertExecutor, _swiglu
from moe_runtime.hybrid.kernel_choice import choose_kernels, eligible_kernels
from moe_runtime.hybrid.layer_share import CPUExperts, expert_rows
from moe_runtime.layers.experts import _hidden
from moe_runtime.quant.cast import CastCodec
from moe_runtime.quant.fp8 import Fp8BlockCodec
from moe_runtime.quant.int8 import Int8ChannelCodec
from moe_runtime.quant.mxfp4 import Mxfp4Codec
from moe_runtime.stats import ExpertStats


def test_plans_are_aligned_ranges_about_one_per_thread():
    store = make_store()
    k = Linear(store)
    gu, down = CPUExpertExecutor(store, None, 3, min_unit_bytes=1).plans(k)
    for plan, n in ((gu, 2 * I), (down, H)):
        assert plan[0][0] == 0 and plan[-1][1] == n and len(plan) <= 3
        assert all(a % ROW_ALIGN == 0 and a < b for a, b in plan)
        assert all(b == a2 for (_, b), (a2, _) in zip(plan, plan[1:]))
    assert CPUExpertExecutor(store, None, 1, min_unit_bytes=1).plans(k) == ([(0, 2 * I)], [(0, H)])
    # at least min_unit_bytes of weights per range: the bundled-size expert stays whole
    assert CPUExpertExecutor(store, None, 3).plans(k) == ([(0, 2 * I)], [(0, H)])
    assert gate_up_pieces(32, 16, 48) == [("gate", 16, 32), ("up", 0, 16)]


@pytest.mark.parametrize(
    "dtype,codec",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, Int8ChannelCodec()),
     (torch.float32, Mxfp4Codec()), (torch.float32, CastCodec(torch.bfloat16, "bf16"))],
    ids=["fp32", "bf16", "int8", "mxfp4", "cast-bf16"],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_split_expert_gives_the_whole_products_bits(dtype, codec, rows):
    store = make_store(dtype, codec)
    ex = CPUExpertExecutor(store, None, 3, min_unit_bytes=1)
    try:
        kernels = eligible_kernels(store)
        ex.check_split(kernels)
        x = torch.randn(rows, H).to(dtype)
        for k in kernels:
            if k.name in ex.whole:
                continue
            assert sum(map(len, ex.plans(k))) > 2, k.name  # it does split
            for e in range(E):
                got = ex.run_one(k, e, x)
                assert torch.equal(got, run_projections(k, e, x, _swiglu)), (k.name, e)
                if k.exact:  # the device path's bits
                    assert torch.equal(got, device_path(store.expert(e).clone(), x, store))
        assert {k.name for k in kernels if k.exact} & ex.whole == set()
    finally:
        ex.close()


def test_fp8_gemv_splits_where_fp8_dequant_runs_whole():
    """fp8's block scales span rows: its ``dequant`` runs whole, while ``fp8-gemv`` (the scales by
    absolute row block) splits by ranges and gives the whole product's bits."""
    store = make_store(torch.float32, Fp8BlockCodec((16, 16)))
    ex = CPUExpertExecutor(store, None, 3, min_unit_bytes=1)
    try:
        kernels = eligible_kernels(store)
        ex.check_split(kernels)
        dequant, gemv = kernels
        assert (dequant.name, gemv.name) == ("dequant", "fp8-gemv") and gemv.name not in ex.whole
        assert sum(map(len, ex.plans(dequant))) == 2 and sum(map(len, ex.plans(gemv))) > 2
        x = torch.randn(3, H)
        for e in range(E):
            assert torch.equal(ex.run_one(gemv, e, x), run_projections(gemv, e, x, _swiglu))
    finally:
        ex.close()


def test_a_kernel_whose_ranges_differ_runs_whole():
    class Skewed(Linear):  # its ranges are off by a rounding: not the whole product
        name = "skewed"

        def gate_up_rows(self, key, x, r0, r1):
            y = super().gate_up_rows(key, x, r0, r1)
            return y if (r0, r1) == (0, 2 * I) else y * (1 + 1e-6)

    store = make_store()
    k = Skewed(store)
    ex = CPUExpertExecutor(store, None, 3, min_unit_bytes=1)
    try:
        ex.check_split([k, Linear(store)])
        assert ex.whole == {"skewed"} and ex.plans(k) == ([(0, 2 * I)], [(0, H)])
        x = torch.randn(2, H)
        assert torch.equal(ex.run_one(k, 1, x), run_projections(k, 1, x, _swiglu))
    finally:
        ex.close()


def test_layer_share_splits_every_expert_and_places_its_outputs():
    """Five CPU experts over three threads, each split: outputs scaled by their router weights at
    their (token, rank) positions, one sample per expert whose seconds add up to the batch."""
    store = make_store()
    ex = CPUExpertExecutor(store, choose_kernels(store, (1,), repeats=1), 3, min_unit_bytes=1)
    try:
        ids = np.array([[0, 2], [2, 4], [4, 0], [1, 3], [5, 2]])
        x = torch.randn(5, H)
        weights = torch.softmax(torch.randn(5, 2), dim=-1)
        stats = ExpertStats(1)
        share = CPUExperts(ex, 0, [0, 1, 2, 3, 4, 5], E, stats)
        share.start(x, ids, None)
        out = {tuple(p.tolist()): y for p, _, y in share.finish(x, weights)}
        for e, (tok, col, pos) in expert_rows(ids).items():
            want = device_path(store.expert(e).clone(), x[torch.from_numpy(tok)], store)
            want = want * weights.reshape(-1)[torch.from_numpy(tok * 2 + col)].unsqueeze(1)
            assert torch.equal(out[tuple(pos.tolist())], want)
        assert len(ex.samples) == E and all(s > 0 for _, s in ex.samples)
        assert stats.cpu_expert_s == pytest.approx(sum(s for _, s in ex.samples))
    finally:
        ex.close()


def test_a_failing_unit_raises_in_finish_without_hanging():
    class Broken(Linear):
        name = "broken"

        def gate_up_rows(self, key, x, r0, r1):
            if r0:
                raise RuntimeError("unit failed")
            return super().gate_up_rows(key, x, r0, r1)

    store = make_store()
    choice = choose_kernels(store, (1,), repeats=1, kernels=[Broken(store)])
    ex = CPUExpertExecutor(store, None, 3, min_unit_bytes=1)
    ex.choice = choice  # unchecked: its ranges run
    try:
        share = CPUExperts(ex, 0, [1, 3], E, ExpertStats(1))
        share.start(torch.randn(2, H), np.array([[1, 3], [3, 1]]), None)
        with pytest.raises(RuntimeError, match="unit failed"):
            share.finish(torch.randn(2, H), torch.ones(2, 2))
    finally:
        ex.close()


def test_hidden_and_biases_apply_once_to_the_joined_product():
    store = make_store()
    ex = CPUExpertExecutor(store, choose_kernels(store, (1,), repeats=1), 3, min_unit_bytes=1)
    try:
        gu_bias, down_bias = torch.randn(2 * I), torch.randn(H)
        x = torch.randn(3, H)
        e = ex.expert(2, np.arange(3), lambda gu: _hidden(gu, None, gu_bias), down_bias)
        e.xs = x
        ((y, _),) = ex.submit([e], x).wait()
        k = Linear(store)
        want = k.down(2, _hidden(k.gate_up(2, x), None, gu_bias)) + down_bias
        assert torch.equal(y, want)
    finally:
        ex.close()


PROMPTS = [[5, 17, 33, 2], [9, 1, 44, 8, 120]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _logits(runtime: RuntimeConfig) -> tuple[list[torch.Tensor], LLMEngine]:
    rows = []
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, PARAMS)
        while engine.has_unfinished():
            engine.step()
            rows.append(engine.last_logits.clone())
    return rows, engine


def test_engine_with_split_experts_keeps_device_bits(monkeypatch):
    """The bundled model's experts split over three threads (ranges forced small): ``cpu`` and
    ``auto`` give ``device``'s logits; the placement sees the pool as one CPU lane."""
    monkeypatch.setattr(executor_mod, "MIN_UNIT_BYTES", 1)
    base = dict(max_model_len=64, max_batch_size=2, buffer_slots=16, cpu_expert_threads=3)
    want, _ = _logits(RuntimeConfig(expert_compute="device", **base))
    seen = []
    real = placement_mod.place_layer

    def spy(costs, *args, **kwargs):
        seen.append(costs.cpu_lanes)
        return real(costs, *args, **kwargs)

    monkeypatch.setattr(placement_mod, "place_layer", spy)
    for mode, link in (("cpu", None), ("auto", 0.05)):
        got, engine = _logits(RuntimeConfig(expert_compute=mode, link_gbps=link, **base))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), mode
        st = engine.buffer.stats
        assert sum(st.cpu_experts) > 0 and engine.hybrid.executor.threads == 3
        gu, down = engine.hybrid.executor.plans(engine.hybrid.executor.choice.kernels[0])
        assert len(gu) > 1 and len(down) > 1
    assert seen and set(seen) == {1}


def test_an_unsplit_int8_expert_runs_as_one_fused_call():
    """With one pool thread an int8 expert is one unit: ``Int8Gemv.swiglu`` (gate, up, SiLU and
    down in one compiled call), within fp32 rounding of the kernel's three pieces; an expert with
    its own activation or biases (gpt-oss) keeps the pieces and the device path's activation."""
    store = make_store(torch.float32, Int8ChannelCodec())
    k = next(k for k in eligible_kernels(store) if k.name == "int8-gemv")
    ex = CPUExpertExecutor(store, None, 1)
    calls = []
    swiglu = k.swiglu
    k.swiglu = lambda key, x: calls.append(key) or swiglu(key, x)
    try:
        for rows in (1, 3):
            x = torch.randn(rows, H)
            got = ex.run_one(k, 2, x)
            want = k.down(2, _swiglu(k.gate_up(2, x)))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert calls == [2, 2]
        plans = ex.plans(k)
        assert executor_mod._Expert(2, k, plans, np.arange(1), _swiglu, None, True).whole
        biased = executor_mod._Expert(2, k, plans, np.arange(len(x)), lambda gu: _swiglu(gu) + 1, None, False)
        ((y, _),) = ex.submit([biased], x).wait()
        assert calls == [2, 2] and torch.equal(y, k.down(2, _swiglu(k.gate_up(2, x)) + 1))
    finally:
        ex.close()


def test_the_waiting_thread_takes_the_units_no_worker_took():
    """While every pool thread is busy elsewhere, ``wait`` computes the batch on the calling thread
    (the same bits as the pool's) instead of waiting for a worker; a unit's error is raised in
    ``wait``; without help the batch waits for the pool."""
    store = make_store()
    ex = CPUExpertExecutor(store, choose_kernels(store, (1,), repeats=1), 2, min_unit_bytes=1)
    gate = threading.Event()
    try:
        x = torch.randn(3, H)
        want = [ex.run_one(ex.choice.kernels[0], e, x) for e in (1, 4)]
        busy = [ex.pool.submit(gate.wait) for _ in range(2)]  # both pool threads held
        jobs = [ex.expert(e, np.arange(3), _swiglu, None) for e in (1, 4)]
        batch = ex.submit(jobs, x)
        got = batch.wait(help=True)
        assert not any(f.done() for f in busy)  # the pool did none of it
        assert all(torch.equal(y, w) for (y, _), w in zip(got, want)) and all(s > 0 for _, s in got)

        bad = ex.expert(2, np.arange(3), lambda gu: 1 / 0, None)
        with pytest.raises(ZeroDivisionError):
            ex.submit([bad], x).wait(help=True)

        late = ex.submit([ex.expert(1, np.arange(3), _swiglu, None)], x)
        assert not late.done.wait(0.05)  # nobody works on it while the pool is held
        gate.set()
        ((y, _),) = late.wait(help=False)
        assert torch.equal(y, want[0])
    finally:
        gate.set()
        ex.close()


def test_pool_threads_keep_one_openmp_thread_and_the_engine_device(monkeypatch):
    """With ``--cpu-threads 2`` a pool thread's first parallel op would reset its OpenMP team to 2
    (ATen's per-thread set-up): the initializer runs that set-up first. On CUDA it makes the
    engine's device current (here ``set_device`` is recorded, no GPU touched)."""
    import ctypes

    omp = getattr(ctypes.CDLL(None), "omp_get_max_threads", None)
    if omp is None:
        pytest.skip("no OpenMP runtime in this process")
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        store = make_store(torch.float32)
        ex = CPUExpertExecutor(store, None, 1, device=torch.device("cuda", 1))
        try:

            def work() -> int:
                a = torch.randn(1500, 1500)
                (a @ a).sum()  # a parallel op: ATen's set-up has run by now
                return omp()

            assert ex.pool.submit(work).result() == 1
        finally:
            ex.close()
    finally:
        torch.set_num_threads(before)
    assert bound == [torch.device("cuda", 1)]
