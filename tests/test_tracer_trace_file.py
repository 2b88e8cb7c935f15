"""Trace files (moeserve-trace/1): round trip, EAMs back, errors naming file and line."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracer.errors import TracerError
from tracer.trace_file import TraceRecord, TraceWriter, load_traces, write_traces

L, E, K = 3, 8, 2


def _record(rid: str, tokens: int, prefill: int, seed: int = 0) -> TraceRecord:
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, L, E)), axis=-1)[..., :K]
    return TraceRecord(
        rid, "task", prefill, L, E, K, prefill, ids, rng.random((tokens, L, K), dtype=np.float32)
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(0, 12), data=st.data())
def test_write_load_round_trip(tmp_path: Path, tokens: int, data: st.DataObject) -> None:
    prefill = data.draw(st.integers(0, tokens))
    rec = _record("req-1", tokens, prefill, seed=tokens)
    path = tmp_path / f"t{tokens}_{prefill}.jsonl"
    with TraceWriter(path) as w:
        w.write(rec)
        w.write(_record("req-2", 2, 1))
    back = load_traces(path)
    assert [r.request_id for r in back] == ["req-1", "req-2"]
    got = back[0]
    assert (got.task, got.prompt_len, got.num_layers, got.num_experts, got.top_k, got.num_prefill) == (
        "task", prefill, L, E, K, prefill,
    )  # fmt: skip
    np.testing.assert_array_equal(got.ids, rec.ids)
    np.testing.assert_allclose(got.weights, np.round(rec.weights, 4), atol=1e-7)
    for flag in (True, False, None):
        np.testing.assert_array_equal(got.eam(prefill=flag), rec.eam(prefill=flag))
    assert (got.eam(prefill=True).sum(axis=1) == prefill * K).all()
    assert (got.eam(prefill=False).sum(axis=1) == (tokens - prefill) * K).all()


def test_writer_is_thread_safe(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path)

    def work(i: int) -> None:
        for j in range(10):
            w.write(_record(f"{i}-{j}", 20, 5, seed=j))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert len(load_traces(path)) == 40 == w.written
    with pytest.raises(ValueError, match="closed"):
        w.write(_record("late", 1, 1))


def test_write_traces_is_atomic_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_traces(path, [_record("a", 2, 1)])
    write_traces(path, [_record("b", 2, 1), _record("c", 1, 0)])
    assert [r.request_id for r in load_traces(path)] == ["b", "c"]
    assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]


def _good_line() -> dict:
    return _record("x", 2, 1).to_json()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda o: "{not json", "bad JSON"),
        (lambda o: [1, 2], "expected a JSON object"),
        (lambda o: {**o, "format": "v0"}, "field 'format'"),
        (lambda o: {k: v for k, v in o.items() if k != "ids"}, "missing field 'ids'"),
        (lambda o: {**o, "top_k": 0}, "field 'top_k' must be an int >= 1"),
        (lambda o: {**o, "ids": [[[0, 1], [0]], [[1, 2]]]}, "field 'ids'"),
        (lambda o: {**o, "ids": [[[0, 1]] * L] * 2, "num_layers": L + 1}, "expected \\(T, 4, 2\\)"),
        (lambda o: {**o, "ids": [[[0, E]] * L] * 2}, "outside \\[-1, 8\\)"),
        (lambda o: {**o, "weights": [[[0.1, 0.2]] * L]}, "field 'weights' has shape"),
        (lambda o: {**o, "num_prefill": 3}, "more than the 2 tokens"),
        (lambda o: {**o, "task": 5}, "field 'task' must be a str or null"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, mutate, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    bad = mutate(_good_line())
    lines = [json.dumps(_good_line()), "", bad if isinstance(bad, str) else json.dumps(bad)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TracerError, match=message) as info:
        load_traces(path)
    assert str(info.value).startswith(f"{path}:3: ") and "\n" not in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(TracerError, match="no such trace file"):
        load_traces("/nonexistent/trace.jsonl")
