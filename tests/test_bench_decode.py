"""``moeserve bench decode``: JSON rows carry TPOT spread, HBM and link bounds, and a prefill row.

The figures themselves are measured and vary; the tests check what must hold whatever they are:
bounds positive where bytes are read or moved, bounds equal to bytes / bandwidth, median inside
the spread, the transformers baseline only with every expert resident.
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_runtime.errors import ConfigError
from moeserve.bench.hardware import CUDA_GPUS, gpu_profile, h2d_gbps, hbm_gbps
from moeserve.bench.render import render_decode
from moeserve.cli import main
from moeserve.sim.hardware import GPUS

HBM = 100.0  # --hbm-gbps, so the bound can be recomputed exactly


@pytest.fixture(scope="module")
def bench(tiny_qwen3):
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    args = ["bench", "decode", "--model", str(tiny_qwen3), "--fractions", "1.0,0.25", "--batches", "1,2"]
    args += ["--prompt-len", "6", "--new-tokens", "4", "--prefill-len", "24", "--link-gbps", "0.5"]
    with redirect_stdout(buf):
        assert main([*args, "--hbm-gbps", str(HBM), "--json"]) == 0
    return json.loads(buf.getvalue())


def test_decode_rows_carry_bounds(bench):
    st, rows = bench["settings"], bench["results"]
    assert len(rows) == 2 * 2 * 2  # fractions x (link off, on) x batches
    assert st["hbm_gbps"] == HBM and st["hbm_source"] == "--hbm-gbps" and st["h2d_gbps_measured"] > 0
    for r in rows:
        assert r["tpot_ms_min"] <= r["tpot_ms"] <= r["tpot_ms_max"]
        assert r["cpu_ms"] > 0  # process CPU time per decode step
        assert r["weight_bytes_per_step"] >= st["dense_read_bytes"] + st["expert_bytes"]  # >= 1 expert
        assert r["kv_bytes_per_step"] == r["batch"] * (6 + 4 / 2) * st["kv_bytes_per_token"]
        assert r["hbm_bound_ms"] == pytest.approx(
            1e3 * (r["weight_bytes_per_step"] + r["kv_bytes_per_step"]) / (HBM * 1e9)
        )
        assert r["hbm_bound_ms"] > 0
        if r["h2d_bytes_per_step"] > 0:
            assert r["link_bound_ms"] > 0
        if r["link_gbps"]:  # emulated link: bytes at its bandwidth + latency per expert copy
            copies = r["h2d_bytes_per_step"] / st["expert_bytes"]
            assert r["link_bound_ms"] == pytest.approx(
                1e3 * r["h2d_bytes_per_step"] / (r["link_gbps"] * 1e9) + copies * st["link_latency_us"] * 1e-3
            )
        resident = r["buffer_fraction"] == 1.0
        if resident:
            assert r["h2d_bytes_per_step"] == 0 and r["link_bound_ms"] == 0 and r["hit_rate"] == 1.0
        has_hf = resident and r["link_gbps"] is None
        assert (r["transformers_tpot_ms"] is not None) == has_hf
        if has_hf:
            assert r["transformers_tpot_ms_min"] <= r["transformers_tpot_ms"] <= r["transformers_tpot_ms_max"]
    small = [r for r in rows if r["buffer_fraction"] == 0.25]
    assert all(r["h2d_bytes_per_step"] > 0 for r in small)  # 25% of experts must stream


def test_prefill_rows(bench):
    pre = bench["prefill"]
    assert [r["buffer_fraction"] for r in pre] == [1.0, 0.25]
    for r in pre:
        assert r["prompt_tokens"] == 24
        assert r["cached_tokens"] == 0  # every timed prompt computed, none from the prefix cache
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
        assert r["tokens_per_s"] == pytest.approx(24 / (r["prefill_ms"] / 1e3))
        assert r["hbm_bound_ms"] > 0 and r["kv_bytes"] == 24 * bench["settings"]["kv_bytes_per_token"]
    assert pre[0]["transformers_prefill_ms"] > 0 and pre[1]["transformers_prefill_ms"] is None
    assert pre[1]["h2d_bytes"] > 0 and pre[1]["link_bound_ms"] > 0


def test_render_shows_bounds_and_prefill(bench):
    md = render_decode(bench)
    assert "HBM bound ms" in md and "link bound ms" in md and "prompt tokens/s" in md
    assert "CPU ms/step" in md and f"| {bench['results'][0]['cpu_ms']:.2f} |" in md
    first = bench["results"][0]
    assert f"{first['hbm_bound_ms']:.3f}" in md
    assert "`hbm_source=--hbm-gbps`" in md


def test_too_few_repeats_is_one_line(capsys, tiny_qwen3):
    assert main(["bench", "decode", "--model", str(tiny_qwen3), "--repeats", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeserve: error: --repeats 2") and len(err.splitlines()) == 1


def test_hbm_table_reuses_sim_profiles_and_names_devices():
    assert all(CUDA_GPUS[k] is v for k, v in GPUS.items())
    assert gpu_profile("NVIDIA H100 80GB HBM3").hbm_gbps == GPUS["h100-80gb"].hbm_gbps
    assert gpu_profile("NVIDIA H100 PCIe").name == "h100-pcie"
    assert gpu_profile("NVIDIA GH200 480GB").name == "gh200-96gb"  # not the H200
    assert gpu_profile("NVIDIA H200").name == "h200"
    assert gpu_profile("Tesla T4") is None
    with pytest.raises(ConfigError, match="--hbm-gbps"):
        hbm_gbps(torch.device("cpu"), -1.0)
    gbps, source = hbm_gbps(torch.device("cpu"))
    assert gbps > 0 and "measured" in source
    assert h2d_gbps(torch.device("cpu"), 1 << 16) > 0


def test_expert_dtypes_rows_side_by_side(tiny_qwen3, capsys):
    """``--expert-dtypes bf16,fp8,int8``: one set of rows per format, each with its expert bytes;
    fp8 and int8 experts are about half bf16's."""
    args = ["bench", "decode", "--model", str(tiny_qwen3), "--fractions", "0.25", "--batches", "1"]
    args += ["--prompt-len", "6", "--new-tokens", "4", "--prefill-len", "0", "--link-gbps", "0"]
    args += ["--repeats", "3", "--no-transformers", "--expert-dtypes", "bf16,fp8,int8", "--json"]
    assert main(args) == 0
    bench = json.loads(capsys.readouterr().out)
    rows = {r["expert_dtype"]: r for r in bench["results"]}
    assert set(rows) == {"bf16", "fp8", "int8"}
    assert bench["settings"]["expert_dtypes"] == {k: r["expert_bytes"] for k, r in rows.items()}
    for fmt in ("fp8", "int8"):
        ratio = rows[fmt]["expert_bytes"] / rows["bf16"]["expert_bytes"]
        assert 0.5 < ratio < 0.55, (fmt, ratio)  # plus the scales
        assert rows[fmt]["bytes_per_token"] > 0  # a 25% buffer moves experts every step
    text = render_decode(bench)
    assert "KiB/expert" in text and "fp8" in text
