"""``moeserve bench eamc --capacities``: the precision by capacity on hand-built traces (a
collection too small to hold each task's pattern predicts worse than one that holds them all), the
matcher's cost grows with the capacity, and the table carries every figure; the runtime's and the
simulator's default capacity is the collection's."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import numpy as np

from moe_runtime.config import RuntimeConfig
from moeserve.bench.eamc_capacity import matching_cost, precision, render_capacities
from moeserve.cli import main
from moeserve.sim.engine import SimConfig
from tracer.eamc import DEFAULT_CAPACITY, EAMC
from tracer.trace_file import TraceRecord, TraceWriter

L, E, K = 4, 16, 2


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


def test_a_collection_that_holds_every_task_predicts_better() -> None:
    warm, evals = _records(12, 2, seed=0), _records(12, 1, seed=1)
    small = precision(warm, evals, capacity=2, matches=1)
    full = precision(warm, evals, capacity=24, matches=1)
    assert set(full) == {"eamc d=1", "eamc d=2", "own d=1", "own d=2"}
    assert full["eamc d=1"] > small["eamc d=1"] + 0.1
    assert full["own d=1"] == small["own d=1"]  # the request's own EAM needs no collection


def test_matching_cost_grows_with_the_capacity() -> None:
    small = matching_cost(16, 8, 32, 4, matches=16, repeats=3)
    large = matching_cost(2048, 8, 32, 4, matches=16, repeats=3)
    assert set(small) == {
        f"{n}{s}" for n in ("begin_step_us", "update_rows_us") for s in ("", "_min", "_max")
    }
    assert 0 < small["begin_step_us"] < large["begin_step_us"]
    assert 0 < small["update_rows_us"] < large["update_rows_us"]
    assert small["begin_step_us_min"] <= small["begin_step_us"] <= small["begin_step_us_max"]


def test_the_table_has_a_row_per_capacity_and_the_settings() -> None:
    p = {"eamc d=1": 0.25, "eamc d=2": 0.5, "own d=1": 0.125, "own d=2": 0.0}
    cost = {"begin_step_us": 1500.0, "begin_step_us_min": 1400.0, "begin_step_us_max": 1700.0,
            "update_rows_us": 27.0, "update_rows_us_min": 25.0, "update_rows_us_max": 31.0}  # fmt: skip
    result = {
        "settings": {"traces": "s", "workloads": {"w": {"warm": 3, "eval": 1}}, "matches": 16,
                     "cost_shape": "c", "repeats": 5, "timing": "t", "host": "h", "load_avg_1min": 0.5},
        "rows": [{"capacity": c, "w": p, **cost} for c in (32, 128)],
    }  # fmt: skip
    lines = render_capacities(result).splitlines()
    assert lines[2].startswith("| 32 | 0.250 | 0.500 | 0.125 | 1.50 [1.40-1.70] | 27 [25-31] |")
    assert lines[3].startswith("| 128 |")
    assert "w: 3 warm / 1 eval requests" in lines[-1] and "`matches=16`" in lines[-1]


def test_the_command_on_trace_files(tmp_path, capsys) -> None:
    paths = []
    for name, records in (("warm", _records(6, 2, seed=0)), ("eval", _records(6, 1, seed=1))):
        paths.append(tmp_path / f"{name}.jsonl")
        with TraceWriter(paths[-1]) as w:
            for r in records:
                w.write(r)
    argv = ["bench", "eamc", "--capacities", "4,12", "--layers", "4", "--experts", "16", "--batch", "2"]
    argv += ["--k", "2", "--repeats", "3", "--traces", str(paths[0]), str(paths[1])]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([*argv, "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert [r["capacity"] for r in out["rows"]] == [4, 12]
    assert out["settings"]["workloads"] == {"warm": {"warm": 12, "eval": 6}}
    assert out["settings"]["repeats"] == 3 and "not timed" in out["settings"]["warmup"]
    assert set(out["rows"][0]["warm"]) == {"eamc d=1", "eamc d=2", "own d=1", "own d=2"}
    assert main(["bench", "eamc", "--capacities", "4", "--repeats", "2"]) == 2
    assert "must be >= 3" in capsys.readouterr().err


def test_the_default_capacity_is_the_collections() -> None:
    assert RuntimeConfig().eamc_capacity == DEFAULT_CAPACITY == EAMC(2, 2).capacity
    assert SimConfig(slots=1).eamc_capacity == DEFAULT_CAPACITY
