"""Report side of the replay client: /metrics parsing and deltas, summary statistics, sweep plots."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from clients.errors import ClientError
from clients.http import RequestRecord
from clients.metrics_scrape import diff, parse_metrics
from clients.plots import plot_run, plot_sweep
from clients.report import latency_stats, render, summarize
from clients.sweep import parse_rates, sweep_rows
from richconsole import make_console

# moeserve's layout: per-layer families, and per-device families of the same counts
BEFORE = """# TYPE moeserve_expert_lookups_total counter
moeserve_expert_lookups_total{layer="0"} 10
moeserve_expert_lookups_total{layer="1"} 10
# TYPE moeserve_device_expert_lookups_total counter
moeserve_device_expert_lookups_total{device="0"} 20
# TYPE moeserve_expert_hits_total counter
moeserve_expert_hits_total{layer="0"} 5
moeserve_expert_hits_total{layer="1"} 5
# TYPE moeserve_device_expert_hits_total counter
moeserve_device_expert_hits_total{device="0"} 10
# TYPE moeserve_expert_blocking_seconds_total counter
moeserve_expert_blocking_seconds_total{layer="0"} 1.0
# TYPE moeserve_device_expert_blocking_seconds_total counter
moeserve_device_expert_blocking_seconds_total{device="0"} 1.0
# TYPE moeserve_request_success_total counter
moeserve_request_success_total{finished_reason="length"} 2
moeserve_request_success_total{finished_reason="abort"} 1
# TYPE moeserve_generation_tokens_total counter
moeserve_generation_tokens_total 40
# TYPE moeserve_time_to_first_token_seconds histogram
moeserve_time_to_first_token_seconds_bucket{le="+Inf"} 3
moeserve_time_to_first_token_seconds_count 3
moeserve_time_to_first_token_seconds_sum 0.3
"""


def test_metrics_delta_counts_each_family_once() -> None:
    after = BEFORE
    for old, new in [
        ('layer="0"} 10', 'layer="0"} 30'),  # lookups +20 per layer, +40 per device
        ('layer="1"} 10', 'layer="1"} 30'),
        ('device="0"} 20', 'device="0"} 60'),
        ('layer="0"} 5', 'layer="0"} 20'),  # hits +15 per layer, +30 per device
        ('layer="1"} 5', 'layer="1"} 20'),
        ('device="0"} 10', 'device="0"} 40'),
        ("} 1.0\n", "} 1.5\n"),
        ('"length"} 2', '"length"} 7'),
        ("total 40", "total 90"),
    ]:
        assert old in after
        after = after.replace(old, new)
    d = diff(parse_metrics(BEFORE), parse_metrics(after))
    assert d.expert_lookups == 40 and d.expert_hits == 30 and d.hit_rate == pytest.approx(0.75)
    assert d.hits_by_layer == {"0": pytest.approx(0.75), "1": pytest.approx(0.75)}
    assert d.blocking_s == pytest.approx(0.5)
    assert d.success_by_reason == {"abort": 0, "length": 5} and d.requests_success == 5
    assert d.generation_tokens == 50 and d.prompt_tokens is None


def rec(i: int, ok: bool = True, **kw) -> RequestRecord:
    r = RequestRecord(
        index=i,
        dataset="d",
        task="t",
        scheduled_s=i * 0.5,
        target_prompt_tokens=10,
        max_tokens=4,
        sent_s=i * 0.5 + 0.001,
    )
    if ok:
        r.ttft_s, r.e2e_s, r.tpot_s, r.itl_s, r.output_tokens = (
            0.1 * (i + 1),
            0.5,
            0.02 * (i + 1),
            [0.02] * 3,
            4,
        )
        r.prompt_tokens = 10
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_summary_counts_percentiles_goodput() -> None:
    records = [rec(i) for i in range(5)] + [
        rec(5, ok=False, status="http_error", http_status=503, error="HTTP 503: busy"),
        rec(6, ok=False, status="http_error", http_status=503, error="HTTP 503: busy"),
        rec(7, ok=False, status="connect_error", error="refused"),
    ]
    s = summarize(records, duration_s=4.0, settings={"rps": 2.0}, slo_tpot_ms=60.0)
    assert (s.requests, s.succeeded, s.failed) == (8, 5, 3)
    assert s.errors == {"connect_error": 1, "http_error 503": 2}
    assert s.output_tokens == 20 and s.prompt_tokens == 50
    assert s.throughput_rps == pytest.approx(5 / 4.0) and s.output_tokens_per_s == pytest.approx(5.0)
    assert s.goodput_rps == pytest.approx(3 / 4.0)  # TPOT 20, 40, 60 ms within 60 ms; 80, 100 not
    assert s.offered_rps == pytest.approx(7 / 3.5)
    assert s.ttft.p50_ms == pytest.approx(300.0) and s.tpot.count == 5 and s.itl.count == 15
    assert s.max_send_lag_ms == pytest.approx(1.0)
    console = Console(record=True, width=120)
    render(s, console)
    text = console.export_text()
    assert "http_error 503" in text and "TPOT" in text and "not available" in text


def test_latency_stats_empty_and_values() -> None:
    assert latency_stats([]).p50_ms is None
    st = latency_stats([0.001 * i for i in range(1, 101)])
    assert st.p50_ms == pytest.approx(50.5) and st.p99_ms == pytest.approx(99.01)


def test_sweep_rates_and_plots(tmp_path: Path) -> None:
    assert parse_rates("0.5, 1,2") == [0.5, 1.0, 2.0]
    for bad in ("", "1,x", "0,1"):
        with pytest.raises(ClientError):
            parse_rates(bad)
    summaries = [summarize([rec(i) for i in range(3)], 2.0, {"rps": r}) for r in (1.0, 2.0)]
    rows = sweep_rows(summaries)
    assert [r["rps"] for r in rows] == [1.0, 2.0] and rows[0]["hit_rate"] is None
    for png in plot_sweep(rows, tmp_path, "test") + [plot_run([rec(i) for i in range(3)], tmp_path, "t")]:
        assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    assert plot_run([rec(0, ok=False, status="timeout")], tmp_path, "t") is None


def test_render_to_a_pipe_keeps_lines_and_numbers_whole() -> None:
    after = BEFORE.replace('layer="0"} 10', 'layer="0"} 1234567890').replace(
        'device="0"} 20', 'device="0"} 1234567900'
    )
    server = diff(parse_metrics(BEFORE), parse_metrics(after))
    settings = {f"setting_{i}": f"value_{i}" for i in range(12)}  # a settings line far over 80 columns
    s = summarize(
        [rec(i) for i in range(3)], duration_s=2.0, settings=settings, slo_tpot_ms=None, server=server
    )
    buf = io.StringIO()
    render(s, make_console(file=buf))
    lines = buf.getvalue().splitlines()
    assert any(line.startswith("Settings: ") and line.endswith("setting_11=value_11") for line in lines)
    assert "Server counters over the run (/metrics after - before)" in lines
    assert any("1234567880 / 0" in line for line in lines)  # lookups delta printed whole
