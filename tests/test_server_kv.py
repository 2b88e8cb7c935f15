"""The paged KV cache at the HTTP edge: ``usage.prompt_tokens_details.cached_tokens`` (completions
and chat, whole and streamed), the Prometheus prefix-cache, preemption and usage metrics, and an
overload of long requests on a small block pool (every request completes or gets a 429, no 5xx,
preemptions counted)."""

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
PROMPT = [(13 * i + 7) % 300 + 10 for i in range(30)]  # 30 tokens: 7 full blocks of 4


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


@pytest.fixture(scope="module")
def running(tiny_qwen3):
    runtime = RuntimeConfig(max_model_len=256, max_batch_size=4, block_size=4)
    engine = LLMEngine.from_pretrained(tiny_qwen3, runtime)
    with serve_in_thread(engine, ServerSettings(served_model_name=MODEL, max_wait_ms=1)) as running:
        yield running


@pytest.fixture(scope="module")
def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_usage_reports_cached_tokens(client, running):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 28  # 7 blocks; the last token computed
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 28
    two = client.completions.create(**{**kw, "prompt": [PROMPT, PROMPT[:10]], "n": 2})
    assert two.usage.prompt_tokens_details.cached_tokens == 28 + 8  # once per prompt, not per choice
    text = httpx.get(running.base_url + "/metrics").text
    assert _metric(text, "moeserve_prefix_cache_hits_total") >= 28 * 3 + 8
    assert _metric(text, "moeserve_prefix_cache_queries_total") >= 30 * 4 + 10
    assert _metric(text, "moeserve_preemptions_total") == 0
    assert 0 <= _metric(text, "moeserve_kv_cache_usage") <= 1


def test_chat_usage_reports_cached_tokens(client):
    system = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Question: why?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens - 4 <= cached < again.usage.prompt_tokens and cached % 4 == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_overload_of_long_requests_completes_or_gets_429(tiny_qwen3):
    """Twelve 60-token requests on a pool of 16 blocks of 4 (one request at most at a time: 4 times
    the admissible load with 8 running and 2 queued): 200 or 429 only, and the 200s finish whole,
    with preemptions counted; greedy outputs equal a lone run's."""
    runtime = RuntimeConfig(max_model_len=64, max_batch_size=8, block_size=4, num_kv_blocks=16)
    engine = LLMEngine.from_pretrained(tiny_qwen3, runtime)
    prompts = [[(7 * i + j) % 300 + 10 for i in range(30)] for j in range(12)]
    body = dict(model=MODEL, max_tokens=30, temperature=0, ignore_eos=True)
    settings = ServerSettings(served_model_name=MODEL, max_wait_ms=1, max_queue=2)
    with serve_in_thread(engine, settings) as running:

        async def one(http, prompt):
            return await http.post("/v1/completions", json={**body, "prompt": prompt}, timeout=300)

        async def all_at_once():
            async with httpx.AsyncClient(base_url=running.base_url) as http:
                return await asyncio.gather(*(one(http, p) for p in prompts))

        replies = asyncio.run(all_at_once())
        statuses = [r.status_code for r in replies]
        assert set(statuses) <= {200, 429} and statuses.count(429) >= 1, statuses
        done = [(p, r.json()) for p, r in zip(prompts, replies) if r.status_code == 200]
        assert len(done) >= 8
        assert all(j["usage"]["completion_tokens"] == 30 for _, j in done)
        lone = httpx.post(
            running.base_url + "/v1/completions", json={**body, "prompt": done[-1][0]}, timeout=60
        )
        assert lone.json()["choices"][0]["text"] == done[-1][1]["choices"][0]["text"]
        text = httpx.get(running.base_url + "/metrics").text
    assert _metric(text, "moeserve_preemptions_total") >= 1
    assert 'moeserve_http_responses_total{route="/v1/completions",status="500"}' not in text
