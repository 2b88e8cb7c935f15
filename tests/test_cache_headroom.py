"""``tools/cache_headroom.py``'s offline replays on hand-built routing: Belady bounds every cache,
LRU's hit rate grows with the slots, and the runtime's ``eam-reuse`` policy, replayed, keeps the
expert the generated tokens use when the prompt favoured another."""

from __future__ import annotations

import numpy as np
import pytest
from tool_module import load_tool

L, E, K = 3, 8, 2


@pytest.fixture(scope="module")
def headroom():
    return load_tool("cache_headroom")


def _routing(seed: int, batches: int = 3, batch: int = 3, prompt: int = 5, decode: int = 8):
    """Per routed layer ``(layer, ids, token_seq, token_prefill, topk)``: each batch one prefill
    step, then ``decode`` steps; each request prefers a few experts per layer (skewed reuse)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(batches):
        ids = [f"b{b}r{i}" for i in range(batch)]
        likes = rng.integers(0, E, size=(batch, L, 3))  # each request's favourite experts per layer
        for step in range(decode + 1):
            n = prompt if step == 0 else 1
            seq = np.repeat(np.arange(batch), n)
            prefill = np.full(len(seq), step == 0)
            for layer in range(L):
                topk = np.empty((len(seq), K), dtype=np.int64)
                for t, r in enumerate(seq):
                    pick = likes[r, layer] if rng.random() < 0.8 else rng.permutation(E)[:3]
                    topk[t] = rng.permutation(np.unique(np.append(pick, rng.integers(0, E, 3))))[:K]
                out.append((layer, ids, seq, prefill, topk))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_belady_bounds_every_cache_and_lru_grows_with_the_slots(headroom, seed: int) -> None:
    routing = _routing(seed)

    def replay(slots, policy, **context):
        return headroom.replay(routing, L, E, K, slots, policy, **context)

    lru = [replay(s, "lru") for s in (6, 10, 16)]
    assert lru == sorted(lru) and lru[-1] > 0
    for s in (6, 10, 16):
        best = replay(s, "oracle")
        assert best >= replay(s, "lru")
        for w in (1.0, 0.05):
            assert best >= replay(s, "eam-reuse", prefill_weight=w) > 0
    assert replay(L * E, "oracle") == replay(L * E, "lru")  # everything fits


def test_replayed_eam_reuse_follows_the_generated_tokens(headroom) -> None:
    """One request: its prompt chose experts 0 and 1 in every layer, its generated tokens 2 and 3;
    with room for two of those four per layer the decode-weighted cache keeps 2 and 3."""
    ids, routing = ["a"], []
    for step in range(12):
        n = 20 if step == 0 else 1
        seq, prefill = np.zeros(n, dtype=np.int64), np.full(n, step == 0)
        pair = [0, 1] if step == 0 else [2, 3]
        for layer in range(L):
            routing.append((layer, ids, seq, prefill, np.tile(pair, (n, 1))))
    slots = L * 2 + 2
    weighted = headroom.replay(routing, L, E, K, slots, "eam-reuse", prefill_weight=0.05)
    flat = headroom.replay(routing, L, E, K, slots, "eam-reuse", prefill_weight=1.0)
    assert weighted > flat
