"""The policy reports' "gap closed" and "bytes vs oracle" columns (simulator and bench policies)."""

from __future__ import annotations

import pytest

from moeserve.bench.policies import PolicyResult
from moeserve.bench.policy_summary import summarise
from moeserve.sim.report import Row, add_relative, gap_closed


def test_gap_closed_is_the_share_of_the_on_demand_to_oracle_gap() -> None:
    assert gap_closed(909.0, 909.0, 394.0) == 0.0
    assert gap_closed(394.0, 909.0, 394.0) == 1.0
    assert gap_closed(651.5, 909.0, 394.0) == pytest.approx(0.5)
    assert gap_closed(993.0, 909.0, 394.0) == pytest.approx(-84 / 515)  # slower than on-demand
    assert gap_closed(10.0, 10.0, 12.0) is None  # no gap to close


def _row(policy: str, prefetch: str, cache: str, slots: int, tpot: float, nbytes: float) -> Row:
    return Row(policy, prefetch, cache, slots, 10, 5, 0.5, 1.0, nbytes, tpot, 4, 0, 0, 0, 0, 0, 10, 0.1)


def test_sim_rows_compare_within_their_buffer_size() -> None:
    rows = [
        _row("on-demand+lru", "on-demand", "lru", 8, 100.0, 400.0),
        _row("on-demand+eam-reuse", "on-demand", "eam-reuse", 8, 80.0, 300.0),
        _row("eam", "eam", "eam", 8, 70.0, 250.0),
        _row("oracle", "oracle", "oracle", 8, 40.0, 200.0),
        _row("on-demand+lru", "on-demand", "lru", 16, 50.0, 100.0),
        _row("eam", "eam", "eam", 16, 45.0, 100.0),  # no oracle at 16 slots
    ]
    add_relative(rows)
    got = {(r.slots, r.policy): (r.gap_closed, r.bytes_vs_oracle) for r in rows}
    assert got[(8, "on-demand+lru")] == (0.0, 2.0)
    assert got[(8, "on-demand+eam-reuse")] == (pytest.approx(1 / 3), 1.5)
    assert got[(8, "eam")] == (pytest.approx(0.5), 1.25)
    assert got[(8, "oracle")] == (1.0, 1.0)
    assert got[(16, "eam")] == (None, None)


def test_bench_rows_compare_within_their_buffer_fraction() -> None:
    rnd = [
        PolicyResult(0.25, 10, "on-demand+lru", 0.1, 5.0, 2048.0, 20.0, 0, 0, 0, 8),
        PolicyResult(0.25, 10, "eam", 0.3, 3.0, 1024.0, 17.0, 4, 4, 2, 8),
        PolicyResult(0.25, 10, "oracle", 0.5, 1.0, 512.0, 14.0, 4, 4, 4, 8),
    ]
    res = summarise([rnd, rnd, rnd])  # identical rounds: medians are the figures themselves
    assert res[1].gap_closed == pytest.approx(0.5) and res[1].bytes_vs_oracle == 2.0
    assert res[0].gap_closed == 0.0 and res[2].gap_closed == 1.0
