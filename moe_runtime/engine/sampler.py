"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs."""

from __future__ import annotations

import torch

from moe_runtime.engine.request import SamplingParams, TokenLogprob


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits [N, V]`` (fp32).

    Greedy rows take the argmax; others apply temperature, then top-k, then top-p (nucleus), and
    draw from the request's own generator so a seeded request's samples do not depend on what it
    was batched with. Logprobs are of the model's distribution (before temperature), natural log.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    lps: list[TokenLogprob | None] = [None] * len(params)
    if any(p.logprobs is not None for p in params):
        logp = logits.log_softmax(dim=-1)
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            top = {}
            if p.logprobs:
                vals, ids = torch.topk(logp[i], p.logprobs)
                top = dict(zip(ids.tolist(), vals.tolist()))
            lps[i] = TokenLogprob(tokens[i], float(logp[i, tokens[i]]), top)
    return tokens, lps
