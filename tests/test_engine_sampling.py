"""Sampling, stopping and request handling of the engine."""

from __future__ import annotations

import pytest

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.errors import RequestError


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with LLMEngine.from_pretrained(
        tiny_qwen3, RuntimeConfig(max_model_len=96, max_batch_size=8, buffer_slots=4)
    ) as eng:
        yield eng


PROMPT = [11, 22, 33, 44, 55]


def test_seeded_sampling_is_reproducible_and_independent_of_batching(engine):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPT], p)[0].output_token_ids
    others = SamplingParams(max_tokens=12, temperature=1.3, seed=7, ignore_eos=True)
    batched = engine.generate([[3, 4], PROMPT, [9, 9, 9]], [others, p, others])[1].output_token_ids
    assert alone == batched
    different = engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True)
    )[0]
    assert different.output_token_ids != alone


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    topk1 = engine.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    )[0]
    assert topk1.output_token_ids == greedy.output_token_ids


def test_stop_token_ids_and_max_tokens(engine):
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert greedy.finish_reason == "length" and len(greedy.output_token_ids) == 10
    stop_at = greedy.output_token_ids[3]
    first = greedy.output_token_ids.index(stop_at)
    out = engine.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop" and out.output_token_ids == greedy.output_token_ids[: first + 1]


def test_stop_string_cuts_text_and_streams_nothing_past_it(engine):
    full = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    text = full.text
    assert len(text) >= 4
    stop = text[2:4]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    engine.add_request("s", PROMPT, params)
    streamed, final = "", None
    while engine.has_unfinished():
        for o in engine.step():
            streamed += o.new_text
            final = o
    assert final.finish_reason == "stop"
    assert streamed == final.text == text[: text.find(stop)]


def test_logprobs_are_returned_per_token(engine):
    out = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))[
        0
    ]
    assert out.logprobs is not None
    engine.add_request("lp", PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))
    lps = []
    while engine.has_unfinished():
        for o in engine.step():
            lps.extend(o.logprobs)
    assert len(lps) == 3
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top) == 2 and max(lp.top.values()) == pytest.approx(lp.logprob)


def test_abort_frees_the_blocks_and_other_requests_continue(engine):
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("y", PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.step()
    assert engine.abort_request("x") and not engine.abort_request("x")
    while engine.has_unfinished():
        engine.step()
    assert engine.num_running == 0 and engine.kv_manager.num_free == engine.kv_manager.num_blocks


def test_bad_requests_are_refused(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request("v", [10**6], SamplingParams())
    with pytest.raises(RequestError, match="96"):
        engine.add_request("long", [1] * 200, SamplingParams())
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not engine.has_unfinished()


def test_per_request_expert_stats_add_up(engine):
    before = engine.buffer.stats.total_lookups
    outs = engine.generate([PROMPT, [7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for o in outs:
        assert o.expert_stats.lookups > 0 and 0 <= o.expert_stats.hits <= o.expert_stats.lookups
    assert engine.buffer.stats.total_lookups > before
