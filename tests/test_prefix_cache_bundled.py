"""Prefix caching on the bundled model through the ``openai`` client: eight chat requests sharing a
1,024-token system prompt, one after another. Requests 2-8 report at least 1,008 cached tokens
(the system prompt's full blocks of 16), and every output equals a server's with
``--no-enable-prefix-caching``. (Their time to first token is measured by ``moeserve bench kv
--prefix-chat``, not here: docs/kv-cache.md.)"""

from __future__ import annotations

import dataclasses

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.tokenizer import Tokenizer
from moeserve.bench.kv_prefix import serve_and_chat, system_prompt, user_turns


def test_shared_system_prompt_is_served_from_the_cache():
    model = default_model_dir()
    system = system_prompt(Tokenizer(model), 1024)
    users = user_turns(8)
    runtime = RuntimeConfig(max_batch_size=8, cpu_threads=1)
    on = serve_and_chat(model, runtime, system, users, max_tokens=12)
    off = serve_and_chat(model, dataclasses.replace(runtime, enable_prefix_caching=False), system, users, 12)
    assert on[0]["prompt_tokens"] > 1024 and on[0]["cached_tokens"] == 0
    assert all(x["cached_tokens"] >= 1008 for x in on[1:]), [x["cached_tokens"] for x in on]
    assert all(x["cached_tokens"] == 0 for x in off)
    assert [x["text"] for x in on] == [x["text"] for x in off]
    assert all(x["text"] for x in on)
