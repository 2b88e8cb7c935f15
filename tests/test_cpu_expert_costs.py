"""``tools/cpu_expert_costs.py``: the grouped path it times really spans the slots it claims, its
figures have the benchmark's shape, and ``--doc`` replaces its block in place."""

from __future__ import annotations

import pytest
from tool_module import load_tool


@pytest.fixture(scope="module")
def costs():
    return load_tool("cpu_expert_costs")


def test_spread_experts_span_the_partition_and_adjacent_ones_one_call(costs) -> None:
    got = costs.span_costs(16, 8, slots=64, used=6, rows=4, calls=2, repeats=3, warmup=0)
    assert got["adjacent"]["span"] == 6 and got["adjacent"]["grouped_calls"] == 1
    assert got["spread"]["span"] == 64
    # gaps of 12 unused slots > MAX_GAP["cpu"]: the spread batch is cut into several calls
    assert got["spread"]["grouped_calls"] > 1
    for d in got.values():
        assert 0 < d["min_us"] <= d["median_us"] <= d["max_us"]


def test_copy_costs_and_the_doc_block(costs, tmp_path, monkeypatch) -> None:
    got = costs.copy_costs(16, 8, rows=2, calls=3, repeats=3, warmup=0)
    assert set(got) == {"after_io_thread_copy", "after_own_copy", "hot"}
    assert all(0 < d["min_us"] <= d["median_us"] <= d["max_us"] for d in got.values())
    doc = tmp_path / "bench.md"
    doc.write_text("# bench\n\nkept\n")
    monkeypatch.setattr(costs, "DOC", doc)
    costs.write_doc("TABLE-1")
    costs.write_doc("TABLE-2")  # replaces the block, does not append a second one
    text = doc.read_text()
    assert text.startswith("# bench\n\nkept\n") and text.count("BEGIN cpu-costs") == 1
    assert "TABLE-2" in text and "TABLE-1" not in text
