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

    def query_sum(self, request_ids, upto_layer):
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
