"""Seeded synthetic request EAMs with group structure, for benchmarks and tests.

NOTE: the model. ``groups`` activation patterns (MoE-Infinity §3.1, "group activation") each
give every layer a skewed expert distribution ``Dirichlet(alpha)``; a request picks one group,
blends it with a request-specific perturbation (weight ``noise``), and routes ``T`` tokens,
``top_k`` choices each, drawn from the blend (a multinomial per layer, so a row sums to
``T * top_k``). This is not a model of any real MoE; it only gives the EAMC clustered data, so
approximate-index recall is measured on something less trivial than uniform noise.
"""

from __future__ import annotations

import numpy as np


def synthetic_eams(
    n: int,
    num_layers: int,
    num_experts: int,
    top_k: int = 2,
    tokens: tuple[int, int] = (16, 256),
    groups: int = 64,
    alpha: float = 0.3,
    noise: float = 0.3,
    seed: int = 0,
    request_seed: int = 0,
) -> np.ndarray:
    """``n`` request EAMs, ``(n, L, E)`` int64, rows summing to ``T * top_k`` (``T`` per request).

    Args:
        n: requests.
        num_layers, num_experts: ``L``, ``E``.
        top_k: choices per token.
        tokens: inclusive range of tokens per request.
        groups: activation patterns the requests are drawn from.
        alpha: Dirichlet concentration (smaller = more skewed rows).
        noise: weight of the request-specific perturbation, in ``[0, 1]``.
        seed: RNG seed of the group patterns.
        request_seed: RNG seed of the requests (same ``seed``, other ``request_seed``: new
            requests from the same patterns, e.g. queries for a filled collection).
    """
    rng = np.random.default_rng(seed)
    patterns = rng.dirichlet(np.full(num_experts, alpha), size=(groups, num_layers))  # [G, L, E]
    req_rng = np.random.default_rng([seed, request_seed])
    group = req_rng.integers(0, groups, size=n)
    own = req_rng.dirichlet(np.full(num_experts, alpha), size=(n, num_layers))  # [n, L, E]
    probs = (1.0 - noise) * patterns[group] + noise * own
    probs /= probs.sum(axis=-1, keepdims=True)
    count = req_rng.integers(tokens[0], tokens[1] + 1, size=n)  # [n]
    draws = np.broadcast_to((count * top_k)[:, None], (n, num_layers))
    return req_rng.multinomial(draws, probs).astype(np.int64)
