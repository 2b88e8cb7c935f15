"""The ``eam-reuse`` cache policy: evict the expert expected to be needed last in the layer loop."""

from __future__ import annotations

import numpy as np
import pytest

from moe_runtime.buffer.cache_policy import make_cache_policy
from moe_runtime.errors import ConfigError

L, E = 4, 5


class CountsRecorder:
    """Every request has the same request EAM ``counts [L, E]``."""

    def __init__(self, counts: np.ndarray) -> None:
        self.counts = counts

    def query(self, request_ids, upto_layer):
        return np.stack([self.counts for _ in request_ids])

    def query_sum(self, request_ids, upto_layer, prefill_weight=1.0):
        return self.query(request_ids, upto_layer).sum(axis=0)


def _policy(counts: np.ndarray, keys: list[int], layer: int, tokens: int = 2):
    pol = make_cache_policy("eam-reuse", len(keys), E, num_layers=L, recorder=CountsRecorder(counts))
    for s, key in enumerate(keys):
        pol.on_fill(s, key, prefetch=False)
    pol.after_routing(layer, ["a"], np.zeros((tokens, 2), dtype=np.int64))
    return pol


def test_equally_likely_experts_go_in_loop_order_the_layer_just_run_first():
    counts = np.full((L, E), 2.0)  # every expert equally likely in every layer
    keys = [2 * E + 1, 3 * E + 1, 0 * E + 1, 1 * E + 1]  # layers 2, 3, 0, 1
    pol = _policy(counts, keys, layer=1)
    # From layer 1 the loop reaches layers 2, 3, 0, then 1 again: layer 1's expert is needed last.
    order = []
    cands = np.arange(len(keys))
    while len(cands):
        v = pol.victim(cands)
        order.append(keys[v] // E)
        cands = cands[cands != v]
    assert order == [1, 0, 3, 2]


def test_an_expert_no_running_request_uses_goes_before_a_used_one():
    counts = np.zeros((L, E))
    counts[2, 0] = 4.0  # the requests' tokens keep choosing expert 0 of layer 2
    keys = [2 * E + 0, 2 * E + 3]
    assert _policy(counts, keys, layer=1).victim(np.arange(2)) == 1
    # ... even when the used one's layer comes round last
    assert _policy(counts, keys, layer=2).victim(np.arange(2)) == 1


def test_reuse_probability_follows_the_token_share():
    counts = np.zeros((L, E))
    counts[1, :2] = [3.0, 1.0]  # 4 tokens x top-1 so far: shares 0.75 and 0.25
    counts[1, 2:] = 0.0
    pol = _policy(counts, [E, E + 1], layer=0, tokens=2)  # top-k 2 in the hook's ids
    # share = counts / tokens where tokens = choices / k = 4 / 2 = 2 -> 1.5 (capped 1) and 0.5
    np.testing.assert_allclose(pol.p_use[E : E + 2], [1.0, 1 - 0.5**2])


def test_needs_the_tracer():
    with pytest.raises(ConfigError, match="eam-reuse needs the request tracer"):
        make_cache_policy("eam-reuse", 4, E, num_layers=L)


def test_outputs_unchanged_on_the_threaded_runtime(tiny_checkpoints):
    from test_policies import _run_policy

    path = tiny_checkpoints["olmoe"]
    prompts = [[5, 17, 33, 2, 250, 7], [9, 1, 44]]
    ref, _, _, _ = _run_policy(path, "on-demand", "lru", prompts)
    outs, hit, _, engine = _run_policy(path, "on-demand", "eam-reuse", prompts)
    assert outs == ref
    assert type(engine.buffer.parts[0].policy).name == "eam-reuse" and 0.0 <= hit <= 1.0


@pytest.mark.parametrize("tokens", [1, 2, 3, 7])
def test_reuse_probs_compiled_and_plain_agree_and_follow_the_formula(tokens: int) -> None:
    from moe_runtime.buffer import reuse_kernel

    rng = np.random.default_rng(tokens)
    counts = rng.integers(0, 5, size=(6, 9)).astype(np.float64)
    counts[2] = 0.0  # a layer no token has reached yet
    compiled, plain = np.full(54, -1.0), np.full(54, -1.0)
    reuse_kernel.reuse_probs(counts, compiled, 1, 5, 2, tokens)
    getattr(reuse_kernel.reuse_probs, "py_func", reuse_kernel.reuse_probs)(counts, plain, 1, 5, 2, tokens)
    np.testing.assert_array_equal(compiled, plain)
    assert (compiled[:9] == -1.0).all() and (compiled[45:] == -1.0).all()  # rows outside 1..4 untouched
    tok = counts.sum(axis=1, keepdims=True)
    share = np.minimum(counts / np.where(tok > 0, tok, 1.0) * 2, 1.0)
    want = (1.0 - (1.0 - share) ** tokens).reshape(-1)
    np.testing.assert_allclose(compiled[9:45], want[9:45], rtol=1e-13, atol=0)
    assert (compiled[18:27] == 0.0).all()


@pytest.mark.parametrize("shape", [(1, 4), (3, 2), (16, 8)])
def test_add_row_probs_adds_the_ids_and_derives_that_row_only(shape: tuple[int, int]) -> None:
    from moe_runtime.buffer import reuse_kernel

    rng = np.random.default_rng(shape[0])
    counts = rng.integers(0, 5, size=(4, 9)).astype(np.float64)
    ids = rng.integers(0, 9, size=shape).astype(np.int64)  # repeats within a token's row allowed
    want_counts = counts.copy()
    np.add.at(want_counts[2], ids.reshape(-1), 1.0)
    want_p = np.full(36, -1.0)
    reuse_kernel.reuse_probs(want_counts, want_p, 2, 3, shape[1], shape[0])
    for fn in (reuse_kernel.add_row_probs, getattr(reuse_kernel.add_row_probs, "py_func", None)):
        if fn is None:
            continue
        c, p = counts.copy(), np.full(36, -1.0)
        fn(c, p, 2, ids)
        np.testing.assert_array_equal(c, want_counts)
        np.testing.assert_array_equal(p, want_p)  # row 2 derived, the others untouched


def test_add_rows_probs_equals_one_call_per_layer_in_order() -> None:
    """The batched update of the layers no victim followed (a layer may repeat: a whole pass
    wrapped into the next step) equals :func:`add_row_probs` once per layer, in order."""
    from moe_runtime.buffer import reuse_kernel

    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, size=(4, 9)).astype(np.float64)
    layers = np.array([1, 2, 3, 0, 1], dtype=np.int64)
    ids = [rng.integers(0, 9, size=(3, 2)).astype(np.int64) for _ in layers]
    want_c, want_p = counts.copy(), np.full(36, -1.0)
    for layer, x in zip(layers.tolist(), ids):
        reuse_kernel.add_row_probs(want_c, want_p, layer, x)
    for fn in (reuse_kernel.add_rows_probs, getattr(reuse_kernel.add_rows_probs, "py_func", None)):
        if fn is None:
            continue
        c, p = counts.copy(), np.full(36, -1.0)
        fn(c, p, layers, np.concatenate(ids))
        np.testing.assert_array_equal(c, want_c)
        np.testing.assert_array_equal(p, want_p)


@pytest.mark.parametrize("victim_every", [0, 1, 3])
def test_deferred_rows_give_the_probabilities_of_a_whole_read(victim_every: int) -> None:
    """Decode layers routed with a victim after every ``victim_every``-th (0: never, so whole
    passes wait and are derived together): ``p_use`` and the victims equal those of a policy
    that reads the recorder's counts whole at each layer (every layer on the slow path)."""
    from tracer.recorder import RequestRecorder

    rng = np.random.default_rng(victim_every)
    k, T, S = 2, 2, 6
    rec = RequestRecorder(L, E, k)
    for r in ("a", "b"):
        rec.begin_request(r, 3)
    fast = make_cache_policy("eam-reuse", S, E, num_layers=L, recorder=rec)
    whole = make_cache_policy("eam-reuse", S, E, num_layers=L, recorder=rec)
    for s in range(S):
        key = int(rng.integers(0, L * E))
        fast.on_fill(s, key, prefetch=False)
        whole.on_fill(s, key, prefetch=False)
    seq, pre = np.arange(T, dtype=np.int64), np.zeros(T, dtype=bool)
    routed = 0
    for _ in range(3):  # steps
        ids_list = ["a", "b"]  # one list object per step, as the engine passes it
        for layer in range(L):
            ids = rng.integers(0, E, size=(T, k)).astype(np.int64)
            rec.record(layer, ids_list, seq, pre, ids, None)
            fast.after_routing(layer, ids_list, ids)
            whole._seen = None  # forces the whole read (query_sum) at every layer
            whole.after_routing(layer, ids_list, ids)
            routed += 1
            if victim_every and routed % victim_every == 0:
                assert fast.victim(np.arange(S)) == whole.victim(np.arange(S))
        rec.end_step()
    assert len(fast._pending) < L  # a whole pass never waits
    np.testing.assert_array_equal(fast.p_use, whole.p_use)
    assert fast.victim(np.arange(S)) == whole.victim(np.arange(S))


@pytest.mark.parametrize("seed", range(6))
def test_reuse_victim_is_the_furthest_expected_use_ties_lowest_slot(seed: int) -> None:
    from moe_runtime.buffer import reuse_kernel

    rng = np.random.default_rng(seed)
    slots, layers, experts = 12, 4, 5
    keys = rng.integers(0, layers * experts, size=slots)
    p_use = rng.choice([0.0, 1e-4, 0.3, 0.3, 1.0], size=layers * experts)  # repeats: ties happen
    recency = rng.choice([1.0, 2.0], size=slots)
    evictable = rng.random(slots) < 0.6
    layer = int(rng.integers(0, layers))
    counts, none_pending = np.zeros((layers, experts)), reuse_kernel.NO_IDS
    got = reuse_kernel.reuse_victim(
        evictable, keys, p_use, recency, layer, layers, experts, counts, none_pending
    )
    plain = getattr(reuse_kernel.reuse_victim, "py_func", reuse_kernel.reuse_victim)
    assert got == plain(evictable, keys, p_use, recency, layer, layers, experts, counts, none_pending)
    cands = np.flatnonzero(evictable)
    if not cands.size:
        assert got == -1
        return
    dist = (keys[cands] // experts - layer - 1) % layers + 1
    score = dist + layers * (1.0 / np.maximum(p_use[keys[cands]], 1e-3) - 1.0) - 1e-9 * recency[cands]
    assert got == int(cands[np.argmax(score)])  # argmax: the first (lowest) slot among equal scores
    none = np.zeros(slots, dtype=bool)
    assert (
        reuse_kernel.reuse_victim(none, keys, p_use, recency, 0, layers, experts, counts, none_pending) == -1
    )


def test_decode_routing_outweighs_the_prompts() -> None:
    """A request whose prompt kept choosing expert 0 and whose generated tokens choose expert 1:
    with the default prefill weight the cache expects expert 1 next (and evicts expert 0 first);
    counting every token alike (weight 1) it would still favour the prompt's expert 0."""
    from tracer.recorder import RequestRecorder

    k = 1

    def run(weight: float):
        rec = RequestRecorder(L, E, k)
        rec.begin_request("a", 40)
        pol = make_cache_policy("eam-reuse", 2, E, num_layers=L, recorder=rec)
        pol.prefill_weight = weight
        pol.on_fill(0, 2 * E + 0, prefetch=False)
        pol.on_fill(1, 2 * E + 1, prefetch=False)
        prompt = np.zeros((40, k), dtype=np.int64)  # 40 prompt tokens on expert 0 everywhere
        seq, pre = np.zeros(40, dtype=np.int64), np.ones(40, dtype=bool)
        for layer in range(L):
            rec.record(layer, ["a"], seq, pre, prompt, None)
            pol.after_routing(layer, ["a"], prompt)
        rec.end_step()
        one = np.ones((1, k), dtype=np.int64)
        dseq, dpre = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool)
        for _ in range(6):  # 6 generated tokens on expert 1 everywhere
            for layer in range(L):
                rec.record(layer, ["a"], dseq, dpre, one, None)
                pol.after_routing(layer, ["a"], one)
            rec.end_step()
        return pol

    from moe_runtime.buffer.policies import PREFILL_WEIGHT

    default = run(PREFILL_WEIGHT)
    assert default.p_use[2 * E + 1] > default.p_use[2 * E + 0]
    assert default.victim(np.arange(2)) == 0
    flat = run(1.0)
    assert flat.p_use[2 * E + 0] > flat.p_use[2 * E + 1]
    assert flat.victim(np.arange(2)) == 1


def test_prefill_weight_out_of_range_rejected() -> None:
    from moe_runtime.buffer.policies import EAMReuseCachePolicy

    with pytest.raises(ConfigError, match="prefill_weight"):
        EAMReuseCachePolicy(2, E, num_layers=L, recorder=CountsRecorder(np.zeros((L, E))), prefill_weight=1.5)
