"""``moeserve bench kv --prefix-chat``: prefix caching measured through the OpenAI client.

Eight chat requests share a system prompt of ``--system-tokens`` tokens (1,024 by default, on the
bundled model whose context is 2,048) and differ in the user turn. They are sent one after
another, streamed, to an in-process server (uvicorn on loopback, ``server.testing``): the first
prefills the whole prompt, the others find the system prompt's full blocks in the prefix cache.
Per request: time to first token (first streamed content, from the request's start),
``usage.prompt_tokens_details.cached_tokens`` and the text. Each repeat starts a fresh engine
(an empty cache) and warms it with one short request that shares no prefix; a server with
``--no-enable-prefix-caching`` answers the same requests once, for the output comparison.
Reported: the first request's TTFT, the median TTFT of the others, their ratio (median and
spread over the repeats), the least cached tokens of requests 2..8 and whether every output
equals the uncached server's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from moe_runtime.paths import shown_path
from moeserve.bench.policy_summary import spread

#: the vocabulary of the shared system prompt (one string: a word list, split when used)
TEXT = (
    "the model serves experts from host memory and copies each one to the device when a layer "
    "needs it while a cache keeps the likely ones close and a planner guesses the next layer from "
    "the routing it has seen so far in this request and in requests like it"
)


def system_prompt(tokenizer: Any, tokens: int, seed: int = 0) -> str:
    """A fixed pseudo-English text that the tokenizer turns into about ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(TEXT.split(), size=tokens * 2))
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


def user_turns(count: int) -> list[str]:
    return [f"Question {i + 1}: which expert does layer {i + 3} load first, and why?" for i in range(count)]


def chat_turns(base_url: str, model: str, system: str, users: list[str], max_tokens: int) -> list[dict]:
    """Send each user turn after the shared ``system`` prompt, one after another, streamed; per
    request ``{"ttft_s", "cached_tokens", "prompt_tokens", "text"}``."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    out = []
    for user in users:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        t0 = time.perf_counter()
        ttft, text, usage = None, [], None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content = choice.delta.content
                if (content or choice.finish_reason) and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(content or "")
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        out.append(
            {
                "ttft_s": ttft,
                "cached_tokens": cached,
                "prompt_tokens": usage.prompt_tokens,
                "text": "".join(text),
            }
        )
    return out


def serve_and_chat(
    model_dir: Path, runtime: Any, system: str, users: list[str], max_tokens: int, warmup: bool = True
) -> list[dict]:
    """Start an engine and server for ``runtime``, run :func:`chat_turns`, stop them. ``warmup``
    first sends one short request that shares nothing with them (the first forward passes of a
    process are slower)."""
    from moe_runtime.engine.engine import LLMEngine
    from server.settings import ServerSettings
    from server.testing import serve_in_thread

    engine = LLMEngine.from_pretrained(model_dir, runtime)
    with serve_in_thread(engine, ServerSettings(served_model_name="bench", max_wait_ms=1)) as running:
        if warmup:
            chat_turns(running.base_url, "bench", "Be brief.", ["Hello?"], max_tokens)
        return chat_turns(running.base_url, "bench", system, users, max_tokens)


def run_prefix_chat(
    model_dir: Path,
    runtime: Any,
    system_tokens: int = 1024,
    requests: int = 8,
    max_tokens: int = 16,
    repeats: int = 3,
) -> dict:
    """The measurement (module docstring); ``runtime`` a ``RuntimeConfig`` with prefix caching on."""
    import dataclasses

    from moe_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(Path(model_dir))
    system = system_prompt(tokenizer, system_tokens)
    users = user_turns(requests)
    uncached = serve_and_chat(
        model_dir, dataclasses.replace(runtime, enable_prefix_caching=False), system, users, max_tokens
    )
    runs = [serve_and_chat(model_dir, runtime, system, users, max_tokens) for _ in range(repeats)]
    firsts = [r[0]["ttft_s"] for r in runs]
    later = [statistics.median(x["ttft_s"] for x in r[1:]) for r in runs]
    ratios = [b / a for a, b in zip(firsts, later)]
    return {
        "settings": {
            "model": shown_path(model_dir),
            "system_tokens": system_tokens,
            "requests": requests,
            "max_tokens": max_tokens,
            "repeats": repeats,
            "block_size": runtime.block_size,
            "max_batch_size": runtime.max_batch_size,
            "cpu_threads": runtime.cpu_threads,
            "device": runtime.device,
            "dtype": runtime.dtype,
        },
        "prompt_tokens": runs[0][0]["prompt_tokens"],
        "first_ttft_ms": _spread([1000 * x for x in firsts]),
        "later_ttft_ms": _spread([1000 * x for x in later]),
        "ratio": _spread(ratios),
        "uncached_first_ttft_ms": 1000 * uncached[0]["ttft_s"],
        "uncached_later_ttft_ms": 1000 * statistics.median(x["ttft_s"] for x in uncached[1:]),
        "cached_tokens": [x["cached_tokens"] for x in runs[0]],
        "min_cached_later": min(x["cached_tokens"] for r in runs for x in r[1:]),
        "outputs_equal": all([x["text"] for x in r] == [x["text"] for x in uncached] for r in runs),
    }


def _spread(values: list[float]) -> dict[str, float]:
    """``{median, min, max}`` of ``values`` (:func:`moeserve.bench.policy_summary.spread`)."""
    return dict(zip(("median", "min", "max"), spread(values)))


def render(result: dict) -> str:
    """The result as a few lines of text, settings first."""
    s = result["settings"]
    settings = ", ".join(f"{k}={v}" for k, v in s.items())
    r, f, later = result["ratio"], result["first_ttft_ms"], result["later_ttft_ms"]
    return "\n".join(
        [
            f"settings: {settings}",
            f"prompt tokens: {result['prompt_tokens']}; cached tokens per request: {result['cached_tokens']}",
            f"TTFT request 1: {f['median']:.1f} ms ({f['min']:.1f}-{f['max']:.1f}); requests 2-"
            f"{s['requests']} median: {later['median']:.1f} ms ({later['min']:.1f}-{later['max']:.1f})",
            f"ratio later/first: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}), {s['repeats']} repeats",
            f"without prefix caching: first {result['uncached_first_ttft_ms']:.1f} ms, later median "
            f"{result['uncached_later_ttft_ms']:.1f} ms; outputs equal: {result['outputs_equal']}",
        ]
    )
