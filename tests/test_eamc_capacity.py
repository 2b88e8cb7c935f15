"""``tools/eamc_capacity.py``: the precision by capacity on hand-built traces (a collection too
small to hold each task's pattern predicts worse than one that holds them all), the matcher's cost
grows with the capacity, and the table carries every figure; the runtime's and the simulator's
default capacity is the collection's."""

from __future__ import annotations

import numpy as np
import pytest
from tool_module import load_tool

from moe_runtime.config import RuntimeConfig
from moeserve.sim.engine import SimConfig
from tracer.eamc import DEFAULT_CAPACITY, EAMC
from tracer.trace_file import TraceRecord

L, E, K = 4, 16, 2


@pytest.fixture(scope="module")
def tool():
    return load_tool("eamc_capacity")


def _records(tasks: int, per_task: int, seed: int, tokens: int = 12) -> list[TraceRecord]:
    """Requests of ``tasks`` tasks; each task routes every token to its own two experts per layer
    (a different pair per task), with a little noise."""
    rng = np.random.default_rng(seed)
    pairs = np.random.default_rng(7).integers(0, E, size=(tasks, L, K))
    out = []
    for t in range(tasks):
        for i in range(per_task):
            ids = np.repeat(pairs[t][None], tokens, axis=0).copy()  # [T, L, K]
            flip = rng.random(ids.shape) < 0.1
            ids[flip] = rng.integers(0, E, size=int(flip.sum()))
            for tok in range(tokens):  # distinct ids per token and layer
                for lay in range(L):
                    if ids[tok, lay, 0] == ids[tok, lay, 1]:
                        ids[tok, lay, 1] = (ids[tok, lay, 0] + 1) % E
            out.append(
                TraceRecord(
                    request_id=f"t{t}-{seed}-{i}",
                    task=f"t{t}",
                    prompt_len=None,
                    num_layers=L,
                    num_experts=E,
                    top_k=K,
                    num_prefill=0,
                    ids=ids,
                    weights=np.zeros(ids.shape, np.float32),
                )  # fmt: skip
            )
    return out


def test_a_collection_that_holds_every_task_predicts_better(tool) -> None:
    warm, evals = _records(12, 2, seed=0), _records(12, 1, seed=1)
    small = tool.precision(warm, evals, capacity=2, matches=1)
    full = tool.precision(warm, evals, capacity=24, matches=1)
    assert set(full) == {"eamc d=1", "eamc d=2", "own d=1", "own d=2"}
    assert full["eamc d=1"] > small["eamc d=1"] + 0.1
    assert full["own d=1"] == small["own d=1"]  # the request's own EAM needs no collection


def test_matching_cost_grows_with_the_capacity(tool, monkeypatch) -> None:
    monkeypatch.setattr(tool, "COST_SHAPE", (8, 32, 4))
    small, large = tool.matching_cost(16, repeats=3), tool.matching_cost(2048, repeats=3)
    assert set(small) == {"begin_step_us", "update_rows_us"}
    assert 0 < small["begin_step_us"] < large["begin_step_us"]
    assert 0 < small["update_rows_us"] < large["update_rows_us"]


def test_the_table_has_a_row_per_capacity_and_the_settings(tool) -> None:
    p = {"eamc d=1": 0.25, "eamc d=2": 0.5, "own d=1": 0.125, "own d=2": 0.0}
    result = {
        "settings": {
            "model": "m",
            "shape": "s",
            "workloads": {"w": {"warm": 3, "eval": 1}},
            "max_tokens": 4,
            "matches": 16,
            "cost_shape": "c",
            "repeats": 5,
            "host": "h",
        },  # fmt: skip
        "rows": [{"capacity": c, "w": p, "begin_step_us": 1500.0, "update_rows_us": 27.0} for c in (32, 128)],
    }
    text = tool.table(result)
    lines = text.splitlines()
    assert lines[2].startswith("| 32 | 0.250 | 0.500 | 0.125 | 1.50 | 27 |")
    assert lines[3].startswith("| 128 |")
    assert "w: 3 warm / 1 eval requests" in text and "`matches=16`" in text


def test_the_default_capacity_is_the_collections() -> None:
    assert RuntimeConfig().eamc_capacity == DEFAULT_CAPACITY == EAMC(2, 2).capacity
    assert SimConfig(slots=1).eamc_capacity == DEFAULT_CAPACITY
