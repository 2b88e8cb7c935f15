"""The server through the official ``openai`` client (sync, async, streaming) on a real uvicorn
server on loopback, plus batching invariance and /metrics against the engine's own stats."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from server.settings import ServerSettings
from server.testing import serve_in_thread

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def running(tiny_qwen3):
    engine = LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=8, buffer_fraction=0.5))
    with serve_in_thread(engine, ServerSettings(served_model_name=MODEL, max_wait_ms=20)) as running:
        yield running


@pytest.fixture(scope="module")
def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_matches_openai_schema(client, running):
    r = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=5, temperature=0, logprobs=2
    )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert isinstance(r.created, int) and r.created > 1_600_000_000
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    n_out = r.usage.completion_tokens
    assert 1 <= n_out <= 5 and len(choice.logprobs.tokens) == n_out
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert r.usage.prompt_tokens == len(running.app.state.server.tokenizer.encode("The quick brown"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_out
    es = r.usage.model_extra["expert_stats"]
    hybrid = {"cpu_experts", "cpu_expert_ms", "bytes_not_moved"}  # hybrid execution's (0: device mode)
    assert set(es) == {"buffer_hits", "buffer_misses", "blocking_ms"} | hybrid
    assert es["buffer_hits"] + es["buffer_misses"] > 0 and not any(es[k] for k in hybrid)


def test_prompt_forms_n_and_echo(client, running):
    tok = running.app.state.server.tokenizer
    ids = tok.encode("Question: What")
    by_text = client.completions.create(model=MODEL, prompt="Question: What", max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt=[ids, tok.encode("def add")], n=2, max_tokens=3, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy: both choices agree
    assert many.usage.prompt_tokens == len(ids) + len(tok.encode("def add"))
    echoed = client.completions.create(
        model=MODEL, prompt="Question: What", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Question: What" + by_text.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="To be", max_tokens=6, temperature=1.0, seed=7, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_stream_completion_concatenates_to_whole(client):
    whole = client.completions.create(model=MODEL, prompt="A Mixture", max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="A Mixture",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_models_and_async_client(running):
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0)
        models = await aclient.models.list()
        assert [m.id for m in models.data] == [MODEL]
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        rs = await asyncio.gather(
            *(aclient.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0) for p in "abc")
        )
        await aclient.close()
        return ["".join(parts)] + [r.choices[0].text for r in rs]

    assert len(asyncio.run(main())) == 4


def test_batching_changes_nothing(running):
    """32 concurrent greedy requests (more than the 8 batch slots, so requests join and leave the
    running batch) return exactly what each returns alone; so do 8 seeded sampled ones."""
    tok = running.app.state.server.tokenizer
    text = "The quick brown fox jumps over the lazy dog def add return class Stack push self"
    prompts = [tok.encode(text[i % 9 : i % 9 + 4 + 3 * (i % 5)]) for i in range(40)]
    sampling = [{"temperature": 0} if i < 32 else {"temperature": 0.9, "seed": i} for i in range(40)]
    body = dict(model=MODEL, max_tokens=6, ignore_eos=True, logprobs=0)

    async def run_all(concurrent: bool) -> list[dict]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=120) as http:

            async def one(i: int) -> dict:
                r = await http.post("/v1/completions", json={**body, **sampling[i], "prompt": prompts[i]})
                r.raise_for_status()
                choice = r.json()["choices"][0]
                return {"text": choice["text"], **choice["logprobs"]}

            if concurrent:
                return list(await asyncio.gather(*(one(i) for i in range(40))))
            return [await one(i) for i in range(40)]

    engine = running.client.engine
    steps0 = engine.stats.steps
    alone = asyncio.run(run_all(concurrent=False))
    steps1 = engine.stats.steps
    together = asyncio.run(run_all(concurrent=True))
    assert engine.stats.steps - steps1 < (steps1 - steps0) / 4  # they really shared steps
    for a, t in zip(alone, together):
        assert t["text"] == a["text"] and t["tokens"] == a["tokens"]
        assert t["token_logprobs"] == pytest.approx(a["token_logprobs"], abs=1e-3)  # same token ids
        assert len(a["tokens"]) == 6


def _scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if m := re.match(r"^(moeserve_\w+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line):
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_match_engine_stats(client, running):
    client.completions.create(model=MODEL, prompt="Paris", max_tokens=3, temperature=0)
    engine = running.client.engine
    m = _scrape(running.base_url)
    stats = running.client.snapshot.stats
    assert m["moeserve_prompt_tokens_total"] == stats.prompt_tokens == engine.stats.prompt_tokens
    assert m["moeserve_generation_tokens_total"] == engine.stats.generation_tokens
    for reason, count in engine.stats.requests_finished.items():
        assert m[f'moeserve_request_success_total{{finished_reason="{reason}"}}'] == count
    es = engine.buffer.stats
    for layer, (lookups, hits) in enumerate(zip(es.lookups, es.hits)):
        assert m[f'moeserve_expert_lookups_total{{layer="{layer}"}}'] == lookups
        assert m[f'moeserve_expert_hits_total{{layer="{layer}"}}'] == hits
    assert m['moeserve_device_expert_lookups_total{device="0"}'] == es.total_lookups
    assert m["moeserve_expert_copies_total"] == es.copies
    assert m["moeserve_expert_copy_seconds_total"] == es.copy_s
    for layer, batches in enumerate(es.expert_batches):  # a layer runs at least one batch per step
        assert m[f'moeserve_expert_batches_total{{layer="{layer}"}}'] == batches > 0
    # one aggregation level per family: no series carries both labels
    assert not [k for k in m if "layer=" in k and "device=" in k]
    assert m['moeserve_expert_transfer_bytes_total{kind="demand"}'] == es.demand_bytes
    assert m["moeserve_prefetch_issued_total"] == es.prefetch_issued
    term = engine.prefetcher.eamc_term  # the default eam policy weighs its EAMC term
    assert m['moeserve_eamc_term_plans_total{computed="true"}'] == term.used
    assert m['moeserve_eamc_term_plans_total{computed="false"}'] == term.skipped
    assert m["moeserve_eamc_term_host_seconds"] == term.host_s
    assert m["moeserve_requests_running"] == 0 and m["moeserve_requests_waiting"] == 0
    finished = sum(n for r, n in engine.stats.requests_finished.items() if r != "abort")
    assert m["moeserve_e2e_request_latency_seconds_count"] == finished
    assert m["moeserve_time_to_first_token_seconds_count"] == finished
    assert 0 < m["moeserve_time_per_output_token_seconds_count"] <= finished
