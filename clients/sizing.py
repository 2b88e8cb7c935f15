"""How the replay client measures prompt lengths in the server's own tokens, with no flag needed.

Choice, first that works (:func:`choose_counter`):

1. ``--tokenizer PATH``: a local ``tokenizer.json`` (:class:`clients.prompts.HFTokenizer`);
   ``--chars-per-token X``: a fixed estimate.
2. The server's ``POST /tokenize`` (vLLM's API: ``{"model", "prompt", "add_special_tokens"}`` ->
   ``{"count", "tokens"}``): exact counts, prompts cut by character prefix until they fit
   (:class:`ServerTokenizer`).
3. Calibration: one ``POST /v1/completions`` of a sample of the prompt mix with ``max_tokens: 1``
   gives ``usage.prompt_tokens``, hence the server's characters per token on this mix; prompts are
   then sized at that figure divided by :data:`CALIBRATION_SAFETY`, because single prompts vary
   around the mix's mean (on the bundled tokenizer, the 36 requests of the README's replay had 3
   over the context at 1.0 and none at 1.1, for both Azure traces and both prompt files).
4. Neither answers: 4.0 characters per token, the usual figure for English BPE vocabularies.

The probe runs before the run's first ``/metrics`` scrape, so it is not in the report's server
figures (it does reach the server's EAMC, as any request does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx

from clients.options import ReplayConfig
from clients.prompts import (
    DEFAULT_CHARS_PER_TOKEN,
    JOINER,
    CharEstimate,
    HFTokenizer,
    PromptRecord,
    TokenCounter,
)

#: Calibrated chars/token are divided by this (prompts come out ~18% under their target).
CALIBRATION_SAFETY = 1.2


class ServerTokenizer:
    """Token counter over the server's ``POST /tokenize`` (exact, one request per distinct text).

    Raises:
        httpx.HTTPError: the server stops answering (the caller falls back to an estimate).
    """

    def __init__(self, client: httpx.Client, url: str, model: str) -> None:
        self._client, self._url, self._model = client, url.rstrip("/"), model

    def count(self, text: str) -> int:
        r = self._client.post(
            self._url + "/tokenize", json={"model": self._model, "prompt": text, "add_special_tokens": False}
        )
        r.raise_for_status()
        body = r.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])

    def truncate(self, text: str, n: int) -> str:
        """The longest prefix found with at most ``n`` tokens (cut by the measured chars/token)."""
        count = self.count(text)
        while count > n and text:
            keep = min(len(text) - 1, int(len(text) * n / count))
            text = text[: max(0, keep)]
            count = self.count(text) if text else 0
        return text


@dataclass(slots=True, frozen=True)
class Sizing:
    """The counter prompts are sized with, and how it was chosen (printed in the settings)."""

    counter: TokenCounter
    how: str


def _calibrate(
    client: httpx.Client, cfg: ReplayConfig, model: str, prompts: list[PromptRecord], max_context: int
) -> float | None:
    """Characters per token of the server on a sample of the mix, or ``None`` when it will not say."""
    rng = random.Random(cfg.seed)
    sample = ""
    while len(sample) < max_context:  # ~1 char per token at worst for English BPE: fits the context
        sample += prompts[rng.randrange(len(prompts))].prompt + JOINER
    sample = sample[:max_context]
    body = {"model": model, "prompt": sample, "max_tokens": 1, "temperature": 0}
    try:
        r = client.post(cfg.url.rstrip("/") + "/v1/completions", json=body)
        tokens = int(r.json()["usage"]["prompt_tokens"]) if r.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return len(sample) / tokens if tokens > 0 else None


def choose_counter(
    cfg: ReplayConfig, client: httpx.Client, model: str, prompts: list[PromptRecord], max_context: int
) -> Sizing:
    """The most exact token counter available (see the module docstring); never raises for the server."""
    if cfg.tokenizer is not None:
        return Sizing(HFTokenizer(cfg.tokenizer), f"tokenizer {cfg.tokenizer.name}")
    if cfg.chars_per_token is not None:
        return Sizing(CharEstimate(cfg.chars_per_token), f"{cfg.chars_per_token} chars/token")
    server = ServerTokenizer(client, cfg.url, model)
    try:
        server.count("probe")
        return Sizing(server, "server /tokenize")
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    measured = _calibrate(client, cfg, model, prompts, max_context)
    if measured is None:
        how = f"{DEFAULT_CHARS_PER_TOKEN} chars/token (the server could not be measured)"
        return Sizing(CharEstimate(DEFAULT_CHARS_PER_TOKEN), how)
    used = measured / CALIBRATION_SAFETY
    how = f"{used:.2f} chars/token (server's {measured:.2f} / {CALIBRATION_SAFETY})"
    return Sizing(CharEstimate(used), how)
