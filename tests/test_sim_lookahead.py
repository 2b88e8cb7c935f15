"""The simulator's router lookahead: a predictor with a given per-distance precision."""

from __future__ import annotations

import numpy as np
import pytest

from moe_runtime.errors import ConfigError
from moeserve.commands.simulate import lookahead_precision
from moeserve.sim.engine import SimConfig, _lookahead_scores
from tests.test_sim_engine import random_requests, sim_for


def _step_ids(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    return np.stack(
        [np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(tokens)]
    )


def test_guesses_keep_real_experts_with_the_given_precision() -> None:
    rng = np.random.default_rng(0)
    ids = _step_ids(rng, 400, 4, 16, 2)  # [T, L, k]
    exact = _lookahead_scores(ids, 0, 16, np.array([1.0, 0.0]), np.random.default_rng(1))
    np.testing.assert_array_equal(exact[0], np.bincount(ids[:, 1].ravel(), minlength=16))
    assert exact[1].sum() == ids[:, 2].size  # every token still guesses k experts two layers ahead
    # precision 0: no token's guess names one of its real experts
    none = _lookahead_scores(ids[:1], 0, 16, np.array([0.0]), np.random.default_rng(2))
    assert none[0][ids[0, 1]].sum() == 0 and none[0].sum() == 2
    # near the last layer only the layers that exist are guessed
    assert _lookahead_scores(ids, 2, 16, np.array([0.5, 0.5]), np.random.default_rng(3)).shape == (1, 16)


def test_precision_of_the_guesses_matches_the_setting() -> None:
    rng = np.random.default_rng(4)
    ids = _step_ids(rng, 2000, 2, 8, 2)
    # one token at a time: the guess of each token is the count row of that token alone
    gen = np.random.default_rng(5)
    hits = sum(
        _lookahead_scores(ids[t : t + 1], 0, 8, np.array([0.6]), gen)[0][ids[t, 1]].sum() for t in range(2000)
    )
    assert hits / (2000 * 2) == pytest.approx(0.6, abs=0.03)


def test_the_eam_row_uses_the_lookahead_and_eam_paper_does_not() -> None:
    reqs = random_requests(6, 10, 4, 8, 2, 8)
    sim = sim_for(layers=4, experts=8, slots=10, batch=2)
    sim.config = SimConfig(slots=10, batch=2, lookahead_precision=(1.0,))
    state = sim.make_state("eam", "eam-reuse")
    assert state.prefetcher.lookahead_depth == 1 and state.prefetcher.depth == 1
    assert sim.make_state("eam", "eam-reuse", lookahead=0).prefetcher.lookahead_depth == 0
    a = sim.run("eam", "eam-reuse", reqs[:4], reqs[4:])
    assert a.stats == sim.run("eam", "eam-reuse", reqs[:4], reqs[4:]).stats  # seeded


def test_cli_values_are_checked(tmp_path) -> None:
    assert lookahead_precision("0.6,0.5") == (0.6, 0.5)
    assert lookahead_precision(None) == ()
    f = tmp_path / "la.json"
    f.write_text(
        '{"results": [{"distance": 2, "topk_precision": 0.5}, {"distance": 1, "topk_precision": 0.7}]}'
    )
    assert lookahead_precision(str(f)) == (0.7, 0.5)
    for bad in ("1.5", "x", str(tmp_path / "missing.json")):
        with pytest.raises(ConfigError, match="--lookahead-precision"):
            lookahead_precision(bad)
