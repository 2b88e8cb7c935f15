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
