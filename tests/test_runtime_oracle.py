"""Our runtime against transformers (the oracle), for every family, with and without eviction.

Greedy tokens must be identical for 32 new tokens and fp32 logits within 1e-4 at every step, both
with every expert resident and with a 2-slot buffer that forces eviction at every layer; also for
a batch of 4 prompts of different lengths decoded together and for requests joining and leaving
the batch between steps.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109], [77]]
NEW = 32
ATOL = 1e-4


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    """family -> list of (tokens, step logits [NEW, V]) from transformers' greedy generate."""
    out = {}
    for fam in FAMILIES:
        out[fam] = greedy_references(tiny_checkpoints[fam], PROMPTS, NEW)
    return out


def greedy_references(path, prompts: list[list[int]], new: int, **load_kwargs):
    """(fp32 transformers model, [(tokens, step logits [new, V])] per prompt) from greedy generate;
    ``load_kwargs`` go to ``from_pretrained`` (e.g. a ``quantization_config``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_kwargs)
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly ``new`` tokens, like ignore_eos
    gen = transformers.GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            res = model.generate(
                torch.tensor([prompt]),
                generation_config=gen,
                output_logits=True,
                return_dict_in_generate=True,
            )
        refs.append((res.sequences[0, len(prompt) :].tolist(), torch.stack([x[0] for x in res.logits])))
    return model, refs


def check_greedy_matches(path, refs, prompts, slots, runtime: dict) -> None:
    """The first prompt alone, then all ``prompts`` as one batch, greedy for as many tokens as
    ``refs`` (from :func:`greedy_references`) hold: tokens equal and every step's fp32 logits
    within :data:`ATOL`; with ``slots=2`` experts were copied in, with ``None`` all were hits."""
    params = SamplingParams(max_tokens=len(refs[0][0]), temperature=0, ignore_eos=True)
    with LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=slots, **runtime)) as engine:
        single = _run_collecting_logits(engine, prompts[:1], params)
        batch = _run_collecting_logits(engine, prompts, params)
        stats = engine.buffer.stats
    for (tokens, logits), (ref_tokens, ref_logits) in zip(single + batch, refs[:1] + refs):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    if slots == 2:  # 8 experts, top-2, 2 slots: experts are evicted and copied in
        assert stats.demand_bytes > 0 and stats.hit_rate < 0.5
    else:
        assert stats.hit_rate == 1.0 and stats.demand_bytes == 0


def check_prefill_matches(path, model, seq: list[int], runtime: dict) -> None:
    """Our prefill logits of ``seq`` (2-slot buffer) equal transformers' ``model`` forward."""
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=2, **runtime)) as engine:
        got = engine.prefill_logits(seq)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _engine(path, slots):
    return LLMEngine.from_pretrained(
        path, RuntimeConfig(buffer_slots=slots, max_model_len=128, max_batch_size=4)
    )


def _run_collecting_logits(engine, prompts, params):
    """Step the engine to completion; per request, the logits row of each sampled step."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    logits = {rid: [] for rid in ids}
    tokens = {}
    while engine.has_unfinished():
        order = [s.request_id for s in engine.scheduler.running] + [
            s.request_id for s in engine.scheduler.waiting
        ]
        outs = engine.step()
        sampled = [o.request_id for o in outs]
        assert sampled == [r for r in order if r in sampled]
        for row, out in zip(engine.last_logits, outs):
            logits[out.request_id].append(row)
            if out.finished:
                tokens[out.request_id] = out.output_token_ids
    return [(tokens[r], torch.stack(logits[r])) for r in ids]


def assert_matches(results, refs, atol: float = ATOL) -> None:
    """Each ``(tokens, step logits)`` equals its reference's tokens, logits within ``atol``."""
    assert len(results) == len(refs)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(results, refs):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=atol, rtol=0)


def check_buffer_stats(stats, slots: int | None) -> None:
    """At a 2-slot buffer experts were evicted and copied in; all resident, every lookup hit."""
    if slots == 2:
        assert stats.demand_bytes > 0 and stats.hit_rate < 0.5
    else:
        assert stats.hit_rate == 1.0 and stats.demand_bytes == 0


def join_mid_decode(engine, first, second, params, at_step: int = 5) -> dict[str, list[int]]:
    """Run request ``a`` (prompt ``first``), add ``b`` (``second``) before step ``at_step`` (a
    step mixing its prefill with ``a``'s decode); each request's output tokens."""
    engine.add_request("a", first, params)
    finals, step = {}, 0
    while engine.has_unfinished():
        if step == at_step:
            engine.add_request("b", second, params)
        finals.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        step += 1
    return finals


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_prompt_matches_transformers(tiny_checkpoints, references, family, slots):
    _, refs = references[family]
    with _engine(tiny_checkpoints[family], slots) as engine:
        ((tokens, logits),) = _run_collecting_logits(
            engine, [PROMPTS[0]], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        )
        assert tokens == refs[0][0]
        torch.testing.assert_close(logits, refs[0][1], atol=ATOL, rtol=0)
        stats = engine.buffer.stats
        if slots == 2:  # 8 experts, top-2, 2 slots: every layer evicts
            assert stats.demand_bytes > 0 and stats.hit_rate < 0.5
        else:
            assert stats.hit_rate == 1.0 and stats.demand_bytes == 0


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_four_matches_transformers(tiny_checkpoints, references, family, slots):
    _, refs = references[family]
    with _engine(tiny_checkpoints[family], slots) as engine:
        results = _run_collecting_logits(
            engine, PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
        )
    for (tokens, logits), (ref_tokens, ref_logits) in zip(results, refs):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_requests_join_and_leave_between_steps(tiny_checkpoints, references, family):
    """Staggered arrivals and different lengths: each request still gets exactly its solo output."""
    _, refs = references[family]
    lengths = [NEW, 7, 20, 12]
    with _engine(tiny_checkpoints[family], 3) as engine:
        finals = {}
        engine.add_request(
            "a", PROMPTS[0], SamplingParams(max_tokens=lengths[0], temperature=0, ignore_eos=True)
        )
        step = 0
        while engine.has_unfinished() or step < 10:
            if step in (2, 4, 9):
                i = {2: 1, 4: 2, 9: 3}[step]
                engine.add_request(
                    f"r{i}", PROMPTS[i], SamplingParams(max_tokens=lengths[i], temperature=0, ignore_eos=True)
                )
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.output_token_ids
            step += 1
    assert finals["a"] == refs[0][0]
    for i in (1, 2, 3):
        assert finals[f"r{i}"] == refs[i][0][: lengths[i]]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_forward(tiny_checkpoints, references, family):
    model, refs = references[family]
    seq = PROMPTS[2] + refs[2][0]
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0]
    with _engine(tiny_checkpoints[family], 2) as engine:
        got = engine.prefill_logits(seq)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_chunked_prefill_matches_whole_prefill(tiny_checkpoints, references):
    """A prompt larger than the step's token budget is prefilled in chunks with the same result."""
    _, refs = references["qwen3_moe"]
    rt = RuntimeConfig(max_model_len=128, max_batch_size=2, max_num_batched_tokens=4)
    with LLMEngine.from_pretrained(tiny_checkpoints["qwen3_moe"], rt) as engine:
        out = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == refs[2][0]
