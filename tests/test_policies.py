"""Semantics of the prefetch and cache policies (MoE-Infinity §5) on the real buffer and engine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.buffer.cache_policy import LRUPolicy
from moe_runtime.buffer.partition import Partition
from moe_runtime.buffer.policies import EAMCachePolicy
from moe_runtime.io.transfer_queue import Transfer
from moe_runtime.prefetch import make_prefetch_policy
from moe_runtime.prefetch.base import PrefetchPolicy
from moe_runtime.stats import ExpertStats
from moe_runtime.store import HostExpertStore
from tracer.eamc import EAMC

L, E = 4, 5


class FakeRecorder:
    """Returns a fixed EAM so-far for every request."""

    def __init__(self, eam: np.ndarray) -> None:
        self.eam = eam
        self.epoch = 0  # the counts never change

    def query(self, request_ids, upto_layer):
        return np.stack([self.eam for _ in request_ids])

    def query_rows(self, request_ids, lo, hi):
        return self.query(request_ids, hi - 1)[:, lo:hi]

    def query_sum(self, request_ids, upto_layer, prefill_weight=1.0):
        return self.query(request_ids, upto_layer).sum(axis=0)


def FakeEAMC(entries: np.ndarray) -> EAMC:  # noqa: N802 - kept the old fake's name for its callers
    """A real EAMC holding ``entries [n, L, E]`` (rows are L2-normalised on add)."""
    eamc = EAMC(entries.shape[1], entries.shape[2], capacity=len(entries))
    for entry in entries:
        eamc.add(entry)
    return eamc


def fake_eam_policy(buf: ExpertBuffer, eam: np.ndarray, **kwargs) -> PrefetchPolicy:
    """An ``eam`` prefetch policy over ``buf`` whose recorder and EAMC both hold ``eam [L, E]``."""
    layers, experts = eam.shape
    return make_prefetch_policy(
        "eam", buffer=buf, num_layers=layers, num_experts=experts, top_k=2,
        recorder=FakeRecorder(eam), eamc=FakeEAMC(eam[None]), **kwargs,
    )  # fmt: skip


def small_store() -> HostExpertStore:
    store = HostExpertStore(L, E, 4, 2, torch.float32)
    store.data.normal_()
    return store


def test_proximity_weights_follow_the_formula():
    pol = PrefetchPolicy(buffer=None, num_layers=8, num_experts=4, top_k=2, depth=3)
    w = pol.proximity(2)
    expected = np.zeros(8)
    for i in (3, 4, 5):
        expected[i] = 1 - (i - 2) / 8
    np.testing.assert_allclose(w, expected)


def test_eam_plan_priorities_follow_the_formula():
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))  # transfers never finish
    try:
        entry = np.zeros((L, E))
        entry[1] = [0, 3, 1, 0, 0]
        entry[2] = [0, 0, 0, 2, 2]
        entry[3] = [4, 0, 0, 0, 0]
        pol = fake_eam_policy(buf, entry, min_prob=0.0, cost_aware=False)  # the plan as such
        pol.after_routing(0, ["r"], np.zeros((1, 2), dtype=np.int64))
        probs = entry / entry.sum(axis=1, keepdims=True).clip(min=1)
        want = {}
        for i in (1, 2, 3):
            for e in range(E):
                if probs[i, e] > 0:
                    want[i * E + e] = probs[i, e] * (1 - i / L)
        with buf.cond:
            part = buf.parts[0]
            queued = {k: part.queue.queued(k).priority for k in part.queue.queued_prefetch_keys()}
            inflight = set(part.key_slot)  # the first one may already be in flight
        assert set(queued) | inflight == set(want)
        for k, prio in queued.items():
            assert prio == pytest.approx(want[k])
        # nearer layers first: layer-1 expert 1 (0.75 * 3/4) beats layer-3 expert 0 (1.0 * 1/4)
        assert want[1 * E + 1] > want[3 * E + 0]
    finally:
        buf.close()


def test_protected_slots_are_never_evicted():
    stats = ExpertStats(L)
    part = Partition(0, 3, E, 100, LRUPolicy(3, E), stats)
    for key in (0, 1, 2):
        t = Transfer(key, demand=(key != 1))
        slot = part.allocate(t)
        assert slot is not None
        part.land(slot, t)
    part.release(part.key_slot[0])  # slot of key 0: used, unpinned, least recent
    # key 1 is an unused prefetch (protected from prefetches), key 2 is pinned by demand
    victim_for_prefetch = part.allocate(Transfer(10, demand=False))
    assert part.slot_key[victim_for_prefetch] == 10 and 0 not in part.key_slot
    part.land(victim_for_prefetch, Transfer(10, demand=False))
    # now: 10 and 1 are unused prefetches, 2 pinned: a prefetch finds nothing evictable
    assert part.allocate(Transfer(11, demand=False)) is None
    # a demand may take an unused prefetch, never the pinned slot
    s = part.allocate(Transfer(12, demand=True))
    assert s is not None and 2 in part.key_slot and part.slot_key[s] == 12
    assert stats.prefetch_wasted_bytes == 100


def test_eam_cache_priority_resets_to_request_counts_with_early_layer_boost():
    counts = np.zeros((L, E))
    counts[0, 1] = 3
    counts[3, 1] = 3
    pol = EAMCachePolicy(4, E, num_layers=L, recorder=FakeRecorder(counts))
    pol.after_routing(0, ["a", "b"], np.zeros((1, 2), dtype=np.int64))  # two requests -> counts doubled
    pol.on_use(0, 0 * E + 1)
    pol.on_use(1, 3 * E + 1)
    pol.on_use(2, 3 * E + 2)
    assert pol.priority[0] == pytest.approx((6 + 0.5) * (1 + 3 / 4), abs=1e-6)
    assert pol.priority[1] == pytest.approx((6 + 0.5) * 1.0, abs=1e-6)
    assert pol.priority[2] == pytest.approx(0.5, abs=1e-6)
    assert pol.victim(np.array([0, 1, 2])) == 2


def test_next_layer_all_prefetches_the_whole_next_layer():
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 8)
    try:
        pol = make_prefetch_policy("next-layer-all", buffer=buf, num_layers=L, num_experts=E, top_k=2)
        pol.after_routing(1, ["r"], np.zeros((1, 2), dtype=np.int64))
        deadline = time.time() + 5
        while time.time() < deadline and not all(buf.resident(2, e) for e in range(E)):
            time.sleep(0.005)
        assert all(buf.resident(2, e) for e in range(E))
        assert buf.stats.prefetch_issued == E
    finally:
        buf.close()


def test_unknown_policy_names_are_refused():
    from moe_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="prefetch-policy"):
        make_prefetch_policy("magic", buffer=None, num_layers=1, num_experts=1, top_k=1)
    with pytest.raises(ConfigError, match="cache-policy"):
        ExpertBuffer(small_store(), [torch.device("cpu")], 2, cache_policy="magic")


COMBOS = [
    ("on-demand", "lru"),
    ("next-layer-all", "lru"),
    ("model-counts", "model-counts"),
    ("hot-experts", "lru"),
    ("eam", "eam"),
]


def _run_policy(path, prefetch, cache, prompts, context=None, warm=None, log=False):
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams

    rt = RuntimeConfig(
        buffer_slots=6, max_batch_size=2, max_model_len=64, prefetch_policy=prefetch, cache_policy=cache
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLMEngine.from_pretrained(path, rt, policy_context=context) as engine:
        for p in warm or []:
            engine.generate([p], params)
        if log:
            engine.buffer.access_log = []
        st0 = engine.buffer.stats.snapshot()
        outs = [o.output_token_ids for o in engine.generate(prompts, params)]
        st = engine.buffer.stats
        hit = (st.total_hits - st0.total_hits) / (st.total_lookups - st0.total_lookups)
        return outs, hit, engine.buffer.access_log, engine


def test_outputs_identical_across_policies_and_oracle_hits_most(tiny_checkpoints):
    from moe_runtime.prefetch import OracleSchedule

    path = tiny_checkpoints["qwen2_moe"]
    warm = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    prompts = [[5, 17, 33, 2, 250, 7], [9, 1, 44]]
    ref, base_hit, log, _ = _run_policy(path, "on-demand", "lru", prompts, warm=warm, log=True)
    hits = {"on-demand": base_hit}
    for prefetch, cache in COMBOS[1:]:
        outs, hits[prefetch], _, engine = _run_policy(path, prefetch, cache, prompts, warm=warm)
        assert outs == ref, prefetch
        if prefetch == "eam":
            assert len(engine.eamc) == len(warm) + len(prompts)  # filled online by finished requests
    outs, oracle_hit, _, _ = _run_policy(
        path, "oracle", "oracle", prompts, context={"oracle": OracleSchedule(log, 8)}
    )
    assert outs == ref
    assert oracle_hit >= max(hits.values()) - 1e-9, (oracle_hit, hits)


def test_eam_plan_with_no_routed_tokens_is_harmless():
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 8)
    try:
        entry = np.ones((L, E))
        pol = fake_eam_policy(buf, entry)
        pol.after_routing(0, ["r"], np.zeros((0, 2), dtype=np.int64))  # e.g. a trace cell with no token
        pol.after_routing(1, ["r"], np.zeros((1, 2), dtype=np.int64))
        assert pol.last_probs is not None
    finally:
        buf.close()


@pytest.mark.parametrize("name", ["model-counts", "eam-reuse"])
@pytest.mark.parametrize("seed", range(4))
def test_cached_victim_scores_match_the_formula(name: str, seed: int) -> None:
    """The per-slot scores kept between routings pick the victim the formula picks from scratch."""
    from moe_runtime.buffer.cache_policy import make_cache_policy

    rng = np.random.default_rng(seed)
    slots = 6

    class Recorder:
        def query(self, request_ids, layer):
            return rng.integers(0, 4, size=(len(request_ids), L, E)).astype(np.float32)

        def query_sum(self, request_ids, layer, prefill_weight=1.0):
            return self.query(request_ids, layer).sum(axis=0)

    pol = make_cache_policy(name, slots, E, num_layers=L, recorder=Recorder())
    keys = [-1] * slots
    filled_at = [0.0] * slots
    reset_prio = [0.0] * slots  # model-counts: count at the last reset + 1e-9 * tick

    def reference(cands: np.ndarray) -> int:
        ks = np.array([keys[s] for s in cands.tolist()])
        if name == "model-counts":
            return int(cands[np.argmin(pol.counts[ks] + 1e-9 * np.array(reset_prio)[cands])])
        dist = (ks // E - pol.layer - 1) % L + 1
        p = np.maximum(pol.p_use[ks], 1e-3)
        return int(cands[np.argmax(dist + L * (1.0 / p - 1.0) - 1e-9 * np.array(filled_at)[cands])])

    for _ in range(400):
        op = rng.integers(0, 4)
        s = int(rng.integers(0, slots))
        if op == 0:
            topk = rng.integers(0, E, size=(int(rng.integers(1, 4)), 2))
            pol.after_routing(int(rng.integers(0, L)), ["a"], topk)
        elif op == 1:
            keys[s] = int(rng.integers(0, L * E))
            pol.on_fill(s, keys[s], prefetch=bool(rng.integers(0, 2)))
        elif op == 2 and keys[s] >= 0:
            pol.on_use(s, keys[s])
        filled_at[s] = reset_prio[s] = pol.priority[s]
        held = np.array([i for i in range(slots) if keys[i] >= 0])
        if op == 3 and len(held):
            cands = held[rng.random(len(held)) < 0.7]
            if len(cands):
                assert pol.victim(cands) == reference(cands)


@pytest.mark.parametrize("name", ["next-layer-all", "model-counts", "hot-experts"])
def test_baseline_scores_match_their_formulas(name: str) -> None:
    """The baselines' kept state (cached rows, incremental probabilities, pairwise table updates)
    gives exactly the scores of the from-scratch formulas, call after call."""
    rng = np.random.default_rng(3)
    pol = make_prefetch_policy(name, buffer=None, num_layers=L, num_experts=E, top_k=2, depth=2)
    issued: list[np.ndarray] = []

    def issue(scores: np.ndarray, limit: int | None = None, first_layer: int = 0) -> None:
        full = np.zeros((L, E))  # the window of rows, placed in the [L, E] scores
        full[first_layer : first_layer + len(scores)] = scores
        issued.append(full)

    pol.issue = issue
    counts = np.zeros((L, E))
    table = np.zeros((L - 1, E, E))
    for _step in range(6):
        tokens = int(rng.integers(1, 4))
        prev = None
        for layer in range(L):
            ids = np.argsort(rng.random((tokens, E)), axis=1)[:, :2]
            issued.clear()
            pol.after_routing(layer, ["r"], ids)
            want = None
            if name == "next-layer-all" and layer + 1 < L:
                want = np.zeros((L, E))
                want[layer + 1] = 1.0
            elif name == "model-counts":
                counts[layer] += np.bincount(ids.reshape(-1), minlength=E)
                totals = counts.sum(axis=1, keepdims=True)
                prob = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
                want = prob * pol.proximity(layer)[:, None]
            elif name == "hot-experts":
                if prev is not None:
                    for a, b in zip(prev, ids, strict=True):
                        for x in a:
                            for y in b:
                                table[layer - 1, x, y] += 1
                prev = ids
                nxt = np.bincount(ids.reshape(-1), minlength=E) @ table[layer] if layer + 1 < L else 0
                if layer + 1 < L and nxt.sum() > 0:
                    want = np.zeros((L, E))
                    want[layer + 1] = nxt / nxt.sum()
            if want is None:
                assert issued == []
            else:
                assert len(issued) == 1
                np.testing.assert_array_equal(issued[0], want)
        pol.end_step()


def test_eam_cache_counts_updated_per_layer_equal_a_full_sum() -> None:
    """The eam cache policy re-sums only the routed layer within a step; over steps, batch changes
    and finished requests its counts equal the batch's request-EAM sum from scratch."""
    from tracer.recorder import RequestRecorder

    rng = np.random.default_rng(0)
    layers, experts = 4, 6
    rec = RequestRecorder(layers, experts, 2)
    pol = EAMCachePolicy(4, experts, num_layers=layers, recorder=rec)
    live: list[str] = []
    for step in range(12):
        if step % 3 == 0:  # a request joins; sometimes the oldest leaves
            rid = f"r{step}"
            rec.begin_request(rid, 1)
            live.append(rid)
            if len(live) > 2:
                rec.finish(live.pop(0))
        for layer in range(layers):
            ids = np.stack([rng.choice(experts, 2, replace=False) for _ in live])
            rec.record(layer, live, np.arange(len(live)), np.zeros(len(live), bool), ids, np.ones(ids.shape))
            pol.after_routing(layer, live, ids)
            want = rec.query(live, layer).sum(axis=0).reshape(-1)
            np.testing.assert_array_equal(pol.counts, want)
        rec.end_step()


def test_planning_after_the_resident_batch_leaves_outputs_unchanged(tiny_checkpoints, monkeypatch):
    """On an accelerator the prefetch policy plans after the layer's resident experts were issued
    (``moe.plan_after_launch``); forced on the CPU at a buffer that evicts, the eam policy still
    plans and the outputs are on-demand + LRU's."""
    from moe_runtime.layers import moe

    path = tiny_checkpoints["qwen2_moe"]
    prompts = [[5, 17, 33, 2, 250, 7], [9, 1, 44]]
    ref, _, _, _ = _run_policy(path, "on-demand", "lru", prompts)
    order: list[str] = []
    monkeypatch.setattr(moe, "plan_after_launch", lambda device: True)
    real_launch_then = moe.run_experts.__globals__["launch_then"]

    def spy(run, launched):
        order.append("resident" if run.resident_first else "none resident")
        if launched is None:
            return real_launch_then(run, launched)

        def hook():
            order.append("planned")
            launched()

        return real_launch_then(run, hook)

    monkeypatch.setitem(moe.run_experts.__globals__, "launch_then", spy)
    # without the measured trial, whose arms without plans skip the hook after layer 0
    outs, _, _, engine = _run_policy(path, "eam", "eam-reuse", prompts, context={"trial": False})
    assert outs == ref
    assert engine.prefetcher.plans > 0 and "planned" in order
    assert order.count("planned") == sum(1 for o in order if o != "planned")  # once per layer run


def test_policy_names_are_the_registries():
    """The settings check policy names against the lists in ``moe_runtime.config`` (which imports
    no policy code): they are the registries' names, in the registries' order."""
    from moe_runtime.buffer.cache_policy import CACHE_POLICIES
    from moe_runtime.config import CACHE_POLICY_NAMES, PREFETCH_POLICY_NAMES
    from moe_runtime.prefetch import PREFETCH_POLICIES

    assert tuple(CACHE_POLICIES) == CACHE_POLICY_NAMES
    assert tuple(PREFETCH_POLICIES) == PREFETCH_POLICY_NAMES
