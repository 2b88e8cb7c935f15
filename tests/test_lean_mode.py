"""The ``eam`` policy's lean mode costs what on-demand + LRU costs: the recorder counts lazily (equal
to a naive count), the lean ``eam-reuse`` cache takes LRU's victims from the partition's heap, and
a lean MoE layer runs the same aten ops as an on-demand one."""

from __future__ import annotations

import numpy as np
import pytest

from moe_runtime.buffer.cache_policy import LRUPolicy, make_cache_policy
from moe_runtime.buffer.partition import READY, Partition
from moe_runtime.io.transfer_queue import Transfer
from moe_runtime.stats import ExpertStats
from tracer.recorder import RequestRecorder


class _Commits(list):
    """An EAMC stand-in keeping the committed request EAMs as given."""

    def add(self, eam: np.ndarray) -> None:
        self.append(eam.copy())


class _Naive:
    """Request EAMs counted token by token in Python: ``done`` of finished steps, ``step`` of the
    current one, per request ``[2, L, E]``."""

    def __init__(self, L: int, E: int) -> None:
        self.L, self.E = L, E
        self.done: dict[str, np.ndarray] = {}
        self.step: dict[str, np.ndarray] = {}

    def begin(self, rid: str) -> None:
        self.done[rid] = np.zeros((2, self.L, self.E))
        self.step[rid] = np.zeros((2, self.L, self.E))

    def record(self, layer, rids, seq, prefill, ids) -> None:
        for t in range(len(seq)):
            for e in ids[t]:
                self.step[rids[seq[t]]][0 if prefill[t] else 1, layer, e] += 1

    def end_step(self) -> None:
        for rid in self.step:
            self.done[rid] += self.step[rid]
            self.step[rid][:] = 0

    def query(self, rids, upto) -> np.ndarray:
        out = np.stack([self.done[r].sum(axis=0) for r in rids])
        for b, r in enumerate(rids):
            out[b, : upto + 1] += self.step[r].sum(axis=0)[: upto + 1]
        return out

    def finish(self, rid: str) -> np.ndarray:
        return (self.done.pop(rid) + self.step.pop(rid)).sum(axis=0)


@pytest.mark.parametrize("sparse_ratio", [0, 1 << 30])  # every flush dense / every flush sparse
@pytest.mark.parametrize("seed", range(3))
def test_lazy_recorder_counts_equal_a_naive_count_on_random_routing(
    seed: int, sparse_ratio: int, monkeypatch
) -> None:
    import tracer.recorder_counts

    monkeypatch.setattr(tracer.recorder_counts, "_SPARSE_RATIO", sparse_ratio)
    rng = np.random.default_rng(seed)
    L, E, k = 4, 8, 2
    eamc = _Commits()
    rec, ref = RequestRecorder(L, E, k, eamc=eamc), _Naive(L, E)
    live: list[str] = []
    committed: list[np.ndarray] = []
    n = 0
    for _ in range(40):
        while len(live) < 3 or rng.random() < 0.2:  # admit requests: their first step is a prefill
            rid = f"r{n}"
            n += 1
            rec.begin_request(rid, 3)
            ref.begin(rid)
            live.append(rid)
        fresh = set(live[-1:]) if rng.random() < 0.5 else set()
        batch = [r for r in live if rng.random() < 0.8] or live[:1]
        num_new = [int(rng.integers(2, 5)) if r in fresh else 1 for r in batch]
        seq = np.repeat(np.arange(len(batch)), num_new)
        prefill = np.repeat([r in fresh for r in batch], num_new)
        for layer in range(L):
            ids = np.argsort(rng.random((len(seq), E)), axis=1)[:, :k]
            rec.record(layer, batch, seq, prefill, ids, None)
            ref.record(layer, batch, seq, prefill, ids)
            if rng.random() < 0.3:  # a policy reading mid-step
                np.testing.assert_array_equal(rec.query(batch, layer), ref.query(batch, layer))
                np.testing.assert_array_equal(rec.query_sum(batch, layer), ref.query(batch, layer).sum(0))
        if rng.random() < 0.2:  # a request finishing before the step's end
            rid = batch[-1]
            rec.finish(rid)
            committed.append(ref.finish(rid))
            live.remove(rid)
        rec.end_step()
        ref.end_step()
        if live and rng.random() < 0.3:
            np.testing.assert_array_equal(rec.query(live, -1), ref.query(live, -1))
            p, d = rec.request_eam(live[0])
            np.testing.assert_array_equal(np.stack([p, d]), ref.done[live[0]])  # prefill, decode
    for rid in list(live):
        rec.finish(rid)
        committed.append(ref.finish(rid))
    assert len(eamc) == len(committed) > 10
    for got, want in zip(eamc, committed, strict=True):
        np.testing.assert_array_equal(got, want)


def _lean_partition(slots: int, L: int, E: int) -> Partition:
    class Recorder:
        def query_sum(self, request_ids, layer, prefill_weight=1.0):
            return np.ones((L, E), np.float32)

    policy = make_cache_policy("eam-reuse", slots, E, num_layers=L, recorder=Recorder())
    return Partition(0, slots, E, 1, policy, ExpertStats(L))


@pytest.mark.parametrize("seed", range(3))
def test_a_lean_eam_reuse_partition_evicts_as_lru_and_toggles_cleanly(seed: int) -> None:
    """Lean ``eam-reuse`` (the partition's heap) picks LRU's victims, slot for slot; toggled on and
    off mid-run, every victim equals the policy's own choice among the evictable slots."""
    rng = np.random.default_rng(seed)
    L, E, S = 3, 8, 5
    lru = Partition(0, S, E, 1, LRUPolicy(S, E), ExpertStats(L))
    lean = _lean_partition(S, L, E)
    lean.policy.lru = True
    toggled = _lean_partition(S, L, E)
    parts = (lru, lean, toggled)
    for step in range(600):
        if step % 37 == 0:
            toggled.policy.lru = not toggled.policy.lru
        layer = int(rng.integers(0, L))
        for p in parts:
            p.policy.after_routing(layer, ["a"], np.zeros((1, 1), dtype=np.int64))
        key = int(rng.integers(0, L * E))
        demand = bool(rng.random() < 0.7)
        op = rng.random()
        if op < 0.6 and key not in lru.key_slot:  # a copy into a free slot or a victim's
            want = {}
            for p in parts:
                if not p.free:
                    cands = p.evictable(demand)
                    want[id(p)] = p.policy.victim(cands) if len(cands) else None
            got = [p.allocate(Transfer(key, demand)) for p in parts]
            assert got[0] == got[1]  # lean eam-reuse: LRU's slot
            for p, s in zip(parts, got):
                if id(p) in want:
                    assert s == want[id(p)]
                if s is not None:
                    p.land(s, Transfer(key, demand))
        else:  # the compute side uses what is resident
            for p in parts:
                s = p.key_slot.get(key)
                if s is not None and p.state[s] == READY:
                    if p.pins[s]:
                        p.release(s)
                    else:
                        p.pin(s)
                        p.release(s)
                    p.settle_prefetches(key // E, {key})
    assert lean.stats.demand_bytes == lru.stats.demand_bytes > 0


def test_a_lean_moe_layer_runs_the_aten_ops_of_on_demand(monkeypatch) -> None:
    """All experts resident (no copies, so the count is deterministic): the recorder and the lean
    policies add no aten op to a decode MoE layer (the router weights stay on the device)."""
    import moe_runtime.model as model_mod
    from moe_runtime.assets import default_model_dir
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams
    from tests.test_op_counts import _Count

    def ops(prefetch: str, cache: str) -> list[int]:
        counts: list[int] = []
        block = model_mod.moe_block

        def counted(x, *args, **kwargs):
            if x.shape[0] != 2:
                return block(x, *args, **kwargs)
            with _Count() as c:
                out = block(x, *args, **kwargs)
            counts.append(c.ops)
            return out

        monkeypatch.setattr(model_mod, "moe_block", counted)
        rt = RuntimeConfig(max_model_len=32, max_batch_size=2, prefetch_policy=prefetch, cache_policy=cache)
        with LLMEngine.from_pretrained(default_model_dir(), rt) as engine:
            trial = getattr(engine.prefetcher, "trial", None)
            if trial is not None:
                engine.prefetcher.pin("lean")
                assert engine.recorder is not None
            engine.generate([[5, 17, 33], [9, 1, 44]], SamplingParams(max_tokens=3, temperature=0))
        monkeypatch.setattr(model_mod, "moe_block", block)
        return counts

    base = ops("on-demand", "lru")
    assert base and ops("eam", "eam-reuse") == base


@pytest.mark.parametrize("arm", ["cache", "lean", "prefetch"])
def test_an_arm_without_plans_hands_the_policy_only_the_first_layers_routing(arm: str) -> None:
    """While the ``eam`` policy's trial runs an arm without plans (``idle``), the model skips the
    policy's per-layer hook after MoE layer 0 (which starts the trial's step clock) and its router
    lookahead; the prefetching arm gets every layer. Outputs are on-demand + LRU's either way."""
    from moe_runtime.assets import default_model_dir
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams

    def run(prefetch: str, cache: str):
        rt = RuntimeConfig(
            buffer_fraction=0.1,
            max_model_len=32,
            max_batch_size=2,
            prefetch_policy=prefetch,
            cache_policy=cache,
        )
        layers: list[int] = []
        with LLMEngine.from_pretrained(default_model_dir(), rt) as engine:
            pf = engine.prefetcher
            if prefetch == "eam":
                pf.pin(arm)
                assert pf.idle == (arm != "prefetch")
            hook = pf.after_routing

            def counted(layer, *a):
                layers.append(layer)
                return hook(layer, *a)

            pf.after_routing = counted
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            outs = [o.output_token_ids for o in engine.generate([[5, 17, 33], [9, 1, 44]], params)]
            return outs, layers, engine.model.cfg.num_layers

    ref, every, L = run("on-demand", "lru")
    outs, layers, _ = run("eam", "eam-reuse")
    assert outs == ref
    steps = every.count(0)
    assert steps > 1 and len(every) == steps * L
    assert layers == (every if arm == "prefetch" else [0] * steps)


@pytest.mark.parametrize("seed", range(3))
def test_eam_reuse_takes_one_row_per_layer_and_keeps_the_full_recount_victims(seed: int) -> None:
    """The ``eam-reuse`` cache updating only the routed layer's row from its ids (deferred to the
    next victim, routing or read) has the use probabilities, hence the victims, of one re-reading
    every row (``query_sum``) at every layer."""
    rng = np.random.default_rng(seed)
    L, E, k, S = 4, 8, 2, 6
    rec = RequestRecorder(L, E, k)

    class FullOnly:  # the recorder without live_changes: every routing re-reads all rows
        def query_sum(self, request_ids, layer, prefill_weight=1.0):
            return rec.query_sum(request_ids, layer, prefill_weight)

    rowwise = make_cache_policy("eam-reuse", S, E, num_layers=L, recorder=rec)
    full = make_cache_policy("eam-reuse", S, E, num_layers=L, recorder=FullOnly())
    live, n = [], 0
    for step in range(30):
        if step % 7 == 0:  # a request joins (prefill), one leaves
            rec.begin_request(f"r{n}", 3)
            live.append(f"r{n}")
            n += 1
            if len(live) > 3:
                rec.finish(live.pop(0))
        batch = list(live)
        T = len(batch) * (1 if step % 7 else 2)
        seq = np.sort(rng.integers(0, len(batch), size=T))
        seq[: len(batch)] = np.arange(len(batch))
        seq.sort()
        for layer in range(L):
            ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
            rec.record(layer, batch, seq, np.full(T, len(batch) < T), ids, None)  # a joining step: prompt
            fills = [(s, int(rng.integers(0, L * E))) for s in range(S) if rng.random() < 0.3]
            for pol in (rowwise, full):
                pol.after_routing(layer, batch, ids)
                for s, key in fills:
                    pol.on_fill(s, key, prefetch=False)
            # the routed row's update waits for the next victim (in its compiled call), the next
            # routing or a read of p_use: take each path at random layers
            if rng.random() < 0.6:
                assert rowwise.victim(np.arange(S)) == full.victim(np.arange(S))
            if rng.random() < 0.3:
                np.testing.assert_array_equal(rowwise.p_use, full.p_use)
        np.testing.assert_array_equal(rowwise.p_use, full.p_use)
        rec.end_step()
