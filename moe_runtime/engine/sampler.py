"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs.

Each row is sampled on its own: a row that cannot be sampled (NaN logits from a broken
checkpoint, a probability vector with no mass) yields a :class:`SamplingError` in its place and
leaves the other rows' tokens untouched, so one request can fail without failing the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_runtime.engine.request import SamplingParams, TokenLogprob
from moe_runtime.errors import RequestError

MIN_LOGPROB = -9999.0
"""Logprobs are clamped to this (OpenAI's floor), so ``-inf`` never reaches a JSON body."""


class SamplingError(RequestError):
    """One row of logits could not be sampled; only that request fails."""


@dataclass(slots=True)
class Sampled:
    """One row's pick: the token id and, when asked for, its logprobs."""

    token: int
    logprob: TokenLogprob | None


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[Sampled | Exception]:
    """Pick one token per row of ``logits [N, V]`` (fp32).

    Greedy rows (``params.greedy``: temperature below 1e-5) take the argmax; others apply
    temperature, then top-k, then top-p (nucleus; the most likely token is always kept), and draw
    from the request's own generator so a seeded request's samples do not depend on what it was
    batched with. Logprobs are of the model's distribution (before temperature), natural log,
    clamped to :data:`MIN_LOGPROB`.

    Returns:
        one entry per row: a :class:`Sampled`, or the exception that row raised (a
        :class:`SamplingError` for NaN logits or no probability mass).
    """
    tokens = logits.argmax(dim=-1).tolist()
    has_nan = logits.isnan().any(dim=-1).tolist()
    logp = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
    out: list[Sampled | Exception] = []
    for i, p in enumerate(params):
        try:
            if has_nan[i]:
                raise SamplingError("the model produced NaN logits for this request")
            token = tokens[i] if p.greedy else _draw(logits[i], p, generators[i])
            lp = None
            if logp is not None and p.logprobs is not None:
                lp = _logprob(logp[i], token, p.logprobs)
            out.append(Sampled(token, lp))
        except Exception as exc:  # one row's failure is that request's, never the batch's
            out.append(exc)
    return out


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one id from ``row [V]`` with temperature (>= 1e-5), top-k and top-p."""
    row = row / p.temperature  # |logit| / 1e-5 stays far inside float32; softmax subtracts the max
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # however small top_p is (1e-300 is 0 in float32), the top token stays
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    probs = row.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        raise SamplingError(f"no finite probability mass to sample from (temperature {p.temperature})")
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _logprob(logp: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top = {}
    if top_n:
        vals, ids = torch.topk(logp, top_n)
        top = {t: max(v, MIN_LOGPROB) for t, v in zip(ids.tolist(), vals.tolist())}
    return TokenLogprob(token, max(float(logp[token]), MIN_LOGPROB), top)
