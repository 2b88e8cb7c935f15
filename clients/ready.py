"""Wait for a server to come up, then ask it which model it serves and its context length.

:func:`wait_until_ready` polls ``GET /health`` until it answers 200 (a server without a
``/health`` route, which answers 404, is ready once ``GET /v1/models`` answers 200), so a client
started right after ``moeserve serve ... &`` waits for the model to load instead of failing.
:func:`served_model` then reads ``/v1/models``: the model name comes from the server's list (or
``--model``, checked against it), never from a guess. Both fail with one-line
:class:`ServerUnavailable` errors naming the URL, what was tried and for how long.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from clients.errors import ClientError

#: Seconds between two polls of ``/health``.
POLL_INTERVAL_S = 0.25
#: Longest wait for one poll's answer, seconds (a loading server may accept and answer late).
POLL_TIMEOUT_S = 2.0


class ServerUnavailable(ClientError):
    """The server did not come up in time, or would not say which model it serves."""


def _why(exc: httpx.HTTPError, timeout_s: float) -> str:
    """A short reason for a failed poll."""
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({' '.join(str(exc).split()) or 'connection refused'})"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout_s:.2g} s"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _status_line(resp: httpx.Response) -> str:
    text = " ".join(resp.text.split())[:120]
    return f"HTTP {resp.status_code}" + (f" {text}" if text else "")


async def wait_until_ready(
    client: httpx.AsyncClient,
    url: str,
    wait_s: float,
    interval_s: float = POLL_INTERVAL_S,
    poll_timeout_s: float = POLL_TIMEOUT_S,
) -> float:
    """Poll ``{url}/health`` until it answers 200, at most ``wait_s`` seconds.

    A 404 (no ``/health`` route) counts as ready when ``{url}/v1/models`` answers 200. Polls are
    ``interval_s`` apart, the last one at ``wait_s``; at least one is made, also with ``wait_s == 0``.

    Returns:
        seconds waited.

    Raises:
        ServerUnavailable: no 200 within ``wait_s`` (the message names the URL, the polls and the
            last answer or error).
    """
    base = url.rstrip("/")
    start = time.monotonic()
    deadline = start + wait_s
    polls, last = 0, "no poll made"
    while True:
        polls += 1
        timeout = max(0.05, min(poll_timeout_s, deadline - time.monotonic()))
        try:
            resp = await client.get(base + "/health", timeout=timeout)
            if resp.status_code == 200:
                return time.monotonic() - start
            last = f"/health: {_status_line(resp)}"
            if resp.status_code == 404:
                models = await client.get(base + "/v1/models", timeout=timeout)
                if models.status_code == 200:
                    return time.monotonic() - start
                last += f", /v1/models: {_status_line(models)}"
        except httpx.HTTPError as exc:
            last = _why(exc, timeout)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        await asyncio.sleep(min(interval_s, remaining))
    raise ServerUnavailable(
        f"no server ready at {base}: GET {base}/health did not answer 200 within {wait_s:g} s "
        f"({polls} poll(s), every {interval_s:g} s; last: {last}); start the server first or give "
        "--wait-s more seconds"
    )


@dataclass(slots=True, frozen=True)
class ServedModel:
    """What ``/v1/models`` says about the model the run will ask for.

    Attributes:
        id: the model name sent in every request.
        max_model_len: its context length in tokens (prompt + output), ``None`` when the server's
            entry does not state one (the ``max_model_len`` field is an extension of vLLM's and
            moeserve's, not part of OpenAI's API).
        listed: every model id the server listed.
    """

    id: str
    max_model_len: int | None
    listed: tuple[str, ...]


async def served_model(client: httpx.AsyncClient, url: str, wanted: str | None = None) -> ServedModel:
    """The model to ask for, from ``GET {url}/v1/models``.

    Args:
        wanted: ``--model``: must be one of the listed ids. ``None``: the only listed model.

    Raises:
        ServerUnavailable: ``/v1/models`` fails, is not a model list, lists no model, does not list
            ``wanted``, or lists several and ``wanted`` is ``None``.
    """
    where = f"GET {url.rstrip('/')}/v1/models"
    timeout = POLL_TIMEOUT_S * 5
    try:
        resp = await client.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    except httpx.HTTPError as exc:
        why = _why(exc, timeout)
        raise ServerUnavailable(f"{where} failed: {why}; the model to ask for is unknown") from None
    if resp.status_code != 200:
        raise ServerUnavailable(f"{where} answered {_status_line(resp)}; the model to ask for is unknown")
    try:
        body = resp.json()
    except ValueError:
        body = None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        text = " ".join(resp.text.split())[:120]
        raise ServerUnavailable(f"{where} did not answer a model list ({{'data': [...]}}): {text!r}")
    entries = {e["id"]: e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str) and e["id"]}
    listed = tuple(entries)
    if not listed:
        raise ServerUnavailable(f"{where} lists no model; the model to ask for is unknown")
    if wanted is not None and wanted not in entries:
        raise ServerUnavailable(f"--model {wanted!r} is not served: {where} lists {', '.join(listed)}")
    if wanted is None and len(listed) > 1:
        names = ", ".join(listed)
        raise ServerUnavailable(f"{where} lists {len(listed)} models ({names}); choose one with --model")
    name = wanted if wanted is not None else listed[0]
    ctx = entries[name].get("max_model_len")
    max_len = ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None
    return ServedModel(id=name, max_model_len=max_len, listed=listed)
