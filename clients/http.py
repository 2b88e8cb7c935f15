"""OpenAI-compatible HTTP requests that return typed records (never raise for a failed request).

:func:`stream_completion` sends one streaming ``POST /v1/completions`` and times it: TTFT is send to
first non-empty text chunk, inter-token latencies (ITL) are the gaps between later text chunks, TPOT
is ``(e2e - ttft) / (output_tokens - 1)`` as in vLLM's benchmark. Output tokens come from the
final ``usage`` chunk (``stream_options.include_usage``) when the server sends one, else from the
number of text chunks. Timings are ``time.perf_counter`` seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class RequestSpec:
    """One completion request of a run.

    Attributes:
        index: position in the arrival schedule.
        scheduled_s: planned send time, seconds after the run starts.
        prompt: prompt text.
        max_tokens: most output tokens to ask for.
        dataset, task: where the prompt's first piece comes from.
        target_prompt_tokens: prompt length aimed for (client-side estimate), tokens.
        trace_context_tokens, trace_generated_tokens: the trace row's lengths (``None`` without one).
        cut: the prompt was cut shorter than asked so that prompt + ``max_tokens`` fit the context.
    """

    index: int
    scheduled_s: float
    prompt: str
    max_tokens: int
    dataset: str
    task: str
    target_prompt_tokens: int
    trace_context_tokens: int | None = None
    trace_generated_tokens: int | None = None
    cut: bool = False


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request.

    Attributes:
        status: ``ok``, ``http_error`` (a 4xx/5xx answer), ``connect_error`` (no connection),
            ``timeout``, ``stream_error`` (malformed or cut-off stream) or ``client_error``.
        http_status: the HTTP status code, ``None`` when no answer came.
        error: one-line description when ``status != "ok"``.
        sent_s: actual send time, seconds after the run starts.
        ttft_s, tpot_s, e2e_s: latencies in seconds (``None`` when not measurable).
        itl_s: gaps between successive text chunks, seconds.
        prompt_tokens, output_tokens: from the server's ``usage`` (output falls back to chunks).
        finish_reason: the last choice's ``finish_reason``.
        expert_stats: the ``usage.expert_stats`` extension (``buffer_hits``, ``buffer_misses``,
            ``blocking_ms``) when the server sends it.
    """

    index: int
    dataset: str
    task: str
    scheduled_s: float
    target_prompt_tokens: int
    max_tokens: int
    status: str = "ok"
    http_status: int | None = None
    error: str | None = None
    sent_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    chunks: int = 0
    finish_reason: str | None = None
    expert_stats: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """Lines of a ``text/event-stream`` body, split only where the SSE spec splits.

    NOTE: not ``Response.aiter_lines``: it splits like ``str.splitlines``, also at U+2028, U+0085
    and similar, which JSON leaves unescaped, so token text holding one would cut a ``data:``
    line in two. SSE lines end at ``\r\n``, ``\n`` or ``\r`` only; bytes are split before
    decoding so a multi-byte character is never cut.
    """
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if buf:
        yield buf.decode("utf-8")


def _error_message(resp: httpx.Response) -> str:
    """One line from an OpenAI-style error body (``{"error": {"message": ...}}``) or raw text."""
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        text = str(msg if msg is not None else body)
    except (ValueError, AttributeError):
        text = resp.text
    return f"HTTP {resp.status_code}: {' '.join(text.split())[:300]}"


def completion_body(spec: RequestSpec, model: str, ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of a streaming completion request (greedy, usage on the last chunk)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    spec: RequestSpec,
    model: str,
    run_start: float,
    ignore_eos: bool = False,
) -> RequestRecord:
    """Send one streaming completion to ``{url}/v1/completions`` and time it.

    Args:
        client: shared async client (its timeout applies per request).
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        run_start: ``time.perf_counter()`` at the start of the run (for ``sent_s``).

    Returns:
        the record; a failure of any kind is recorded in ``status``/``error``, never raised.
    """
    rec = RequestRecord(
        index=spec.index,
        dataset=spec.dataset,
        task=spec.task,
        scheduled_s=spec.scheduled_s,
        target_prompt_tokens=spec.target_prompt_tokens,
        max_tokens=spec.max_tokens,
    )
    start = time.perf_counter()
    rec.sent_s = start - run_start
    last: float | None = None
    usage: dict[str, Any] | None = None
    done = False
    try:
        body = completion_body(spec, model, ignore_eos)
        async with client.stream("POST", f"{url.rstrip('/')}/v1/completions", json=body) as resp:
            rec.http_status = resp.status_code
            if resp.status_code >= 400:
                await resp.aread()
                rec.status, rec.error = "http_error", _error_message(resp)
                return rec
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.status, rec.error = "stream_error", f"error event: {chunk['error']}"
                    return rec
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                    if not choice.get("text"):
                        continue
                    now = time.perf_counter()
                    rec.chunks += 1
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
    except httpx.ConnectError as exc:
        rec.status, rec.error = "connect_error", f"cannot connect to {url}: {exc}"
        return rec
    except httpx.TimeoutException as exc:
        rec.status, rec.error = "timeout", f"{type(exc).__name__}: {exc}"
        return rec
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        rec.status, rec.error = "stream_error", f"{type(exc).__name__}: {exc}"
        return rec
    except Exception as exc:  # a bug or surprise must not end the run; it is reported instead
        rec.status, rec.error = "client_error", f"{type(exc).__name__}: {exc}"
        return rec
    rec.e2e_s = time.perf_counter() - start
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = int(usage.get("completion_tokens") or rec.chunks)
        if isinstance(usage.get("expert_stats"), dict):
            rec.expert_stats = usage["expert_stats"]
    else:
        rec.output_tokens = rec.chunks
    if not done:
        rec.status, rec.error = "stream_error", "stream ended without data: [DONE]"
    elif rec.ttft_s is not None and rec.output_tokens > 1:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    return rec


async def get_text(client: httpx.AsyncClient, url: str, path: str) -> str | None:
    """``GET {url}{path}`` as text; ``None`` when unreachable or non-2xx."""
    try:
        resp = await client.get(f"{url.rstrip('/')}{path}")
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return resp.text
