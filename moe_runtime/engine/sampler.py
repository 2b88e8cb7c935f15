"""Token sampling: logits processors, greedy, temperature, min-p, top-k, top-p, seeded generators.

Order (vLLM's): grammar mask and ``logit_bias``, then the repetition, frequency and presence
penalties (:func:`process_logits`, vectorised over the rows that use them), then greedy argmax or
temperature -> min-p (vectorised) -> top-k -> top-p -> a draw from the request's own generator.
Rows that use no processor keep their logits untouched, so their tokens are bit-identical to a
plain argmax or draw.

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


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: list[tuple[list[int], list[int]]] | None = None,
    allowed: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Apply grammar masks, ``logit_bias`` and penalties to ``logits [N, V]``.

    Args:
        history: per row, (prompt token ids, output token ids); needed when a row is
            ``penalized``. Presence and frequency penalties count the output only (OpenAI, vLLM);
            the repetition penalty covers prompt and output (transformers, vLLM).
        allowed: row -> bool mask ``[V]`` of the tokens its grammar allows (others get -inf).

    Returns:
        ``logits`` itself when no row uses a processor, else a processed copy (untouched rows
        equal to the input bit for bit).
    """
    pen_rows = [i for i, p in enumerate(params) if p.penalized]
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not (pen_rows or bias_rows or allowed):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for row, mask in (allowed or {}).items():
        logits[row].masked_fill_(~mask, float("-inf"))
    if bias_rows:
        rows = [i for i in bias_rows for _ in params[i].logit_bias]
        ids = [t for i in bias_rows for t in params[i].logit_bias]
        vals = [v for i in bias_rows for v in params[i].logit_bias.values()]
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
            torch.tensor(vals, dtype=logits.dtype, device=dev),
            accumulate=True,
        )
    if pen_rows:
        if history is None:
            raise ValueError("penalties need each row's token history")
        idx = torch.tensor(pen_rows, device=logits.device)
        counts = _token_counts([history[i][1] for i in pen_rows], vocab, logits.device)
        in_prompt = _token_counts([history[i][0] for i in pen_rows], vocab, logits.device) > 0
        rep, freq, pres = (
            torch.tensor(
                [[getattr(params[i], name)] for i in pen_rows], dtype=logits.dtype, device=logits.device
            )
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        )
        sub = logits[idx]
        seen = in_prompt | (counts > 0)
        sub = torch.where(seen & (rep != 1.0), torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[idx] = sub
    return logits


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: ``[len(seqs), vocab]`` float32."""
    width = max((len(s) for s in seqs), default=0)
    padded = torch.full((len(seqs), width), vocab, dtype=torch.int64)  # pad id = vocab, cut below
    for r, s in enumerate(seqs):
        padded[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p [R, 1]`` times their row's top probability.

    ``logits [R, V]`` are after temperature; the top token always stays.
    """
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[tuple[list[int], list[int]]] | None = None,
    allowed: dict[int, torch.Tensor] | None = None,
) -> list[Sampled | Exception]:
    """Pick one token per row of ``logits [N, V]`` (fp32).

    :func:`process_logits` runs first (``history`` and ``allowed`` as there). Greedy rows
    (``params.greedy``: temperature below 1e-5) take the argmax; others apply temperature and
    min-p (batched), then top-k, then top-p (nucleus; the most likely token is always kept), and
    draw from the request's own generator so a seeded request's samples do not depend on what it
    was batched with. Logprobs are of the model's own distribution (before any processor or
    temperature), natural log, clamped to :data:`MIN_LOGPROB`.

    Returns:
        one entry per row: a :class:`Sampled`, or the exception that row raised (a
        :class:`SamplingError` for NaN logits or no probability mass).
    """
    logp = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
    processed = process_logits(logits, params, history, allowed)
    # one device->host copy for the greedy rows: each row's argmax, whether its logits hold a NaN
    # and whether its best processed logit is finite (a grammar mask may leave none)
    host = torch.stack(
        (
            processed.argmax(dim=-1),
            logits.isnan().any(dim=-1).long(),
            processed.amax(dim=-1).isfinite().long(),
        )
    )
    tokens, has_nan, top_finite = host.tolist()
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    scaled: dict[int, torch.Tensor] = {}
    if drawn:
        temps = torch.tensor(
            [[params[i].temperature] for i in drawn], dtype=processed.dtype, device=processed.device
        )
        rows = processed[drawn] / temps  # |logit| / 1e-5 stays far inside float32
        if any(params[i].min_p > 0 for i in drawn):
            min_p = torch.tensor([[params[i].min_p] for i in drawn], dtype=rows.dtype, device=rows.device)
            rows = min_p_filter(rows, min_p)
        scaled = dict(zip(drawn, rows))
    # the drawn rows' (token, mass ok) stay on the device until one copy for all of them
    draws: dict[int, torch.Tensor] = {}
    failed: dict[int, Exception] = {}
    for i in drawn:
        try:
            draws[i] = _draw(scaled[i], params[i], generators[i])
        except Exception as exc:  # that request's, never the batch's
            failed[i] = exc
    picked = dict(zip(draws, torch.stack(list(draws.values())).tolist())) if draws else {}
    out: list[Sampled | Exception] = []
    for i, p in enumerate(params):
        try:
            if has_nan[i]:
                raise SamplingError("the model produced NaN logits for this request")
            if p.greedy and not top_finite[i]:
                raise SamplingError("no token is allowed (grammar mask and logit_bias leave none)")
            if i in failed:
                raise failed[i]
            if not p.greedy and not picked[i][1]:
                raise SamplingError(
                    f"no finite probability mass to sample from (temperature {p.temperature})"
                )
            token = tokens[i] if p.greedy else picked[i][0]
            lp = None
            if logp is not None and p.logprobs is not None:
                lp = token_logprob(logp[i], token, p.logprobs)
            out.append(Sampled(token, lp))
        except Exception as exc:  # one row's failure is that request's, never the batch's
            out.append(exc)
    return out


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one id from ``row [V]`` (already divided by the temperature) with top-k and top-p;
    ``[2]`` int64 on the row's device: the id, and 1 where the row had probability mass to sample
    from (0: the id means nothing). ``torch.multinomial``'s own one-sample algorithm (``argmax(p /
    q)``, ``q ~ Exp(1)`` from the request's generator: the same ids for the same seed) without its
    two host syncs, which would cost two per drawn row and step on a GPU."""
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
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.stack((torch.div(probs, q).argmax(), ok.long()))


def token_logprob(logp: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """``token``'s logprob in ``logp [V]`` (log-softmaxed) and the ``top_n`` best, clamped."""
    top = {}
    if top_n:
        vals, ids = torch.topk(logp, top_n)
        top = {t: max(v, MIN_LOGPROB) for t, v in zip(ids.tolist(), vals.tolist())}
    return TokenLogprob(token, max(float(logp[token]), MIN_LOGPROB), top)
