"""Per-request expert figures (``usage.expert_stats``) against the buffer's own counters: a lone
request is charged every lookup, hit and blocked second of the run; requests sharing steps are
each charged the experts their own tokens used."""

from __future__ import annotations

import math

import pytest

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_lone_request_is_charged_the_whole_run(fraction):
    runtime = RuntimeConfig(max_model_len=64, max_batch_size=2, buffer_fraction=fraction)
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        (out,) = engine.generate([[5, 17, 33, 2]], PARAMS)
        st = engine.buffer.stats
        es = out.expert_stats
        assert es.lookups == sum(st.lookups) > 0
        assert es.hits == sum(st.hits)
        assert (es.hits < es.lookups) == (fraction < 1)
        assert math.isclose(es.blocking_s, sum(st.blocking_s), rel_tol=1e-9, abs_tol=1e-12)


def test_requests_sharing_steps_are_charged_their_own_experts():
    runtime = RuntimeConfig(max_model_len=64, max_batch_size=2, buffer_fraction=0.25)
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        outs = engine.generate([[5, 17, 33, 2], [9, 1, 44]], PARAMS)
        total = sum(engine.buffer.stats.lookups)
        charged = [o.expert_stats.lookups for o in outs]
        # a step's expert counts once in the buffer, once per request whose tokens used it
        assert all(0 < c < total for c in charged) and sum(charged) >= total


@pytest.mark.parametrize("num_new", [[1], [4], [1, 1, 1, 1], [3, 1, 2]])
def test_one_reduction_per_step_charges_what_the_per_layer_form_did(num_new):
    """``StepContext.expert_attribution`` against the per-layer form it replaced: for each MoE
    layer, a sequence is charged the distinct experts its tokens chose, their hits and blocking."""
    import numpy as np
    import torch

    from moe_runtime.engine.context import StepContext

    rng = np.random.default_rng(len(num_new) * 10 + sum(num_new))
    E, k, L = 16, 2, 5
    S = len(num_new)
    tables = [[[i]] for i in range(S)]  # one block of 16 positions each
    step = StepContext.build(
        [f"r{i}" for i in range(S)], tables, [3] * S, num_new, [True] * S, torch.device("cpu"), 16
    )
    want = np.zeros((3, S))
    for _ in range(L):
        ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(sum(num_new))])
        needed = np.unique(ids)
        hit = np.zeros(E, dtype=bool)
        hit[needed] = rng.random(needed.size) < 0.5
        blocked = np.zeros(E)
        blocked[needed[~hit[needed]]] = rng.random(int((~hit[needed]).sum())) * 1e-3
        step.moe_layers.append((ids, hit, blocked))
        for s in range(S):  # the per-layer form
            mine = np.unique(ids[step.token_seq == s])
            want[:, s] += (mine.size, hit[mine].sum(), blocked[mine].sum())
    lookups, hits, blocking = step.expert_attribution(E)
    assert lookups.dtype == hits.dtype == np.int64
    np.testing.assert_array_equal(lookups, want[0])
    np.testing.assert_array_equal(hits, want[1])
    np.testing.assert_allclose(blocking, want[2], rtol=1e-12, atol=1e-18)
    assert (lookups > 0).all() and blocking.sum() > 0
