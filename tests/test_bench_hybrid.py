"""``moeserve bench cpu-experts`` and ``moeserve bench hybrid`` on small inputs: their JSON carries
the settings beside the figures, a row per shape, format, kernel and token count (ms with its
spread, GB/s against the same threads' read roof measured beside it, each expert split over the
pool's threads), and a row per mode (TPOT
median and spread over >= 3 runs, the cost model's prediction error for the hybrid modes)."""

from __future__ import annotations

import json

import pytest

from moeserve.cli import main


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cpu_experts_rows_and_roof(capsys):
    data = _json(
        capsys,
        ["bench", "cpu-experts", "--shapes", "bundled", "--tokens", "1,4", "--formats", "fp32,int8,fp8,mxfp4",
         "--pool-mib", "4", "--roof-mib", "8", "--json"],
    )  # fmt: skip
    s, rows = data["settings"], data["results"]
    assert s["threads"] == 1 and s["repeats"] == 3 and s["roof_gbps_median"] > 0 and "warmup" in s
    kernels = {(r["format"], r["kernel"]) for r in rows}
    assert kernels == {
        ("fp32", "linear"), ("int8", "dequant"), ("int8", "int8-gemv"), ("int8", "int8pack"),
        ("fp8", "dequant"), ("fp8", "fp8-gemv"), ("mxfp4", "dequant"), ("mxfp4", "mxfp4-gemv"),
    }  # fmt: skip
    assert len(rows) == 2 * len(kernels)
    for r in rows:
        assert r["ms_min"] <= r["ms"] <= r["ms_max"] and r["gbps"] > 0 and r["gflops"] > 0
        assert r["roof_pct"] == pytest.approx(100 * r["gbps"] / r["roof_gbps"])
        assert r["exact"] == (r["kernel"] in ("linear", "dequant")) and r["ranges"] == [1, 1]


def test_cpu_experts_split_over_the_pool(capsys):
    """Two threads, ranges of at least 4 KiB: the bundled expert's projections split in two."""
    data = _json(
        capsys,
        ["bench", "cpu-experts", "--shapes", "bundled", "--tokens", "1", "--formats", "fp32",
         "--threads", "2", "--min-unit-kib", "4", "--pool-mib", "4", "--roof-mib", "8", "--json"],
    )  # fmt: skip
    (row,) = data["results"]
    assert data["settings"]["threads"] == 2 and data["settings"]["min_unit_bytes"] == 4096
    assert row["ranges"] == [2, 2] and row["gbps"] > 0


def test_cpu_experts_refuses_bad_flags(capsys):
    assert main(["bench", "cpu-experts", "--formats", "fp64"]) != 0
    assert "--formats: 'fp64' is not one of fp32, bf16, int8, fp8, mxfp4" in capsys.readouterr().err
    assert main(["bench", "cpu-experts", "--repeats", "2"]) != 0
    assert "--repeats must be >= 3" in capsys.readouterr().err


def test_hybrid_rows_per_mode(capsys):
    data = _json(
        capsys,
        ["bench", "hybrid", "--modes", "device,cpu,auto", "--buffer-fraction", "0.25", "--link-gbps", "0.1",
         "--new-tokens", "3", "--prompt-len", "4", "--prefill-len", "40", "--json"],
    )  # fmt: skip
    s, rows = data["settings"], data["results"]
    assert [r["mode"] for r in rows] == ["device", "cpu", "auto"] and s["repeats"] == 3
    assert "expert compute auto" in s["summaries"]["auto"]
    assert s["link_gbps_measured"] == 0.1 and s["host_gbps_measured"] > 0
    for r in rows:
        assert r["tpot_ms_min"] <= r["tpot_ms"] <= r["tpot_ms_max"] and len(r["tpot_ms_runs"]) == 3
        hybrid = r["mode"] != "device"
        assert (r["prediction_error_median"] is not None) == hybrid and (r["fits"] is not None) == hybrid
        assert (r["cpu_experts_per_step"] > 0) == hybrid
        assert 0 < r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
        # the misses' bytes over link plus host memory
        want = r["misses_per_token"] * 98304 / ((0.1 + s["host_gbps_measured"]) * 1e9) * 1e3
        assert r["hybrid_bound_ms"] == pytest.approx(want, rel=0.02) and r["misses_per_token"] > 0
        # the CPU device's step floor: the bundled model's dense weights (5.9 MB) and 32 expert
        # lookups a step (8 layers, top-4) at all cores' read roof, below the step's time
        assert r["lookups_per_step"] == 32
        floor = (6040064 + 32 * 98304) / (s["all_core_read_gbps"] * 1e9) * 1e3
        assert r["step_floor_ms"] == pytest.approx(floor, rel=0.01) and r["step_floor_ms"] < r["tpot_ms"]
    assert rows[1]["moved_mib_per_token"] == 0  # cpu mode copies nothing
    assert rows[1]["misses_per_token"] > rows[0]["misses_per_token"]  # a fixed set: more misses
