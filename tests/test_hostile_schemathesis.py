"""Schemathesis on every route of the OpenAPI schema: no 5xx, the engine stays up.

Bounded: a few dozen generated cases per operation, no deadline per case, the whole module well
under a minute on the tiny checkpoint.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from moe_runtime.config import RuntimeConfig  # noqa: E402
from moe_runtime.engine.engine import LLMEngine  # noqa: E402
from server.settings import ServerSettings  # noqa: E402
from server.testing import serve_in_thread  # noqa: E402

GREEDY = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    engine = LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_batch_size=8, max_model_len=48))
    settings = ServerSettings(served_model_name="tiny", max_wait_ms=0, max_queue=8)
    with serve_in_thread(engine, settings) as running:
        before = httpx.post(running.base_url + "/v1/completions", json=GREEDY, timeout=30).json()
        yield running
        assert running.client.alive and httpx.get(running.base_url + "/health").status_code == 200
        after = httpx.post(running.base_url + "/v1/completions", json=GREEDY, timeout=30).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(served.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx(case, served):
    response = case.call(timeout=30)
    assert response.status_code < 500, (case.body, response.text[:300])
    assert served.client.alive
