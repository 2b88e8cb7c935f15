"""Report side of the replay client: /metrics parsing and deltas, summary statistics, sweep plots."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from clients.errors import ClientError
from clients.http import RequestRecord
from clients.metrics_scrape import diff, parse_metrics
from clients.options import ReplayConfig
from clients.plots import plot_run, plot_sweep
from clients.replay import describe_schedule, schedule_for
from clients.report import latency_stats, render, summarize
from clients.sweep import parse_rates, sweep_rows
from clients.trace import Arrival, Schedule, offered_rate, poisson_schedule, rate_note
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


CONV = "arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"


def conv_schedule(shared_data: Path, **kw) -> Schedule:
    cfg = ReplayConfig(url="http://127.0.0.1:9", prompts=Path("p.jsonl"), trace=shared_data / CONV, **kw)
    return schedule_for(cfg)


def test_rate_note_explains_a_sparse_trace_window(shared_data: Path) -> None:
    """``--rps 1 --duration 60`` from the conv trace's start offers 0.24 req/s: the run's 60 s are
    the trace's first 10.8 s, which hold 15 requests; the trace's whole-file average is 5.53."""
    sched = conv_schedule(shared_data, rps=1.0, duration_s=60.0)
    times = [a.time_s for a in sched.arrivals]
    assert len(times) == 15 and offered_rate(times) == pytest.approx(0.24, abs=0.005)
    note = rate_note(sched, offered_rate(times))
    assert note is not None and note.startswith(
        "offered 0.24 req/s against --rps 1: the 60 s window covers seconds 0.0-10.8 of "
        "AzureLLMInferenceTrace_conv.csv, where the trace runs at 1.33 req/s, sparser than the "
        "5.53 req/s average of the whole file"
    )
    assert "--trace-offset" in note and "\n" not in note
    line = describe_schedule(sched)
    assert line.startswith("schedule: 15 requests over 58.") and line.endswith(note)
    # results.md's replay: 55 requests at 0.451 req/s against 0.5, within 10%: nothing to explain
    docs = conv_schedule(shared_data, rps=0.5, trace_offset_s=60.0, duration_s=120.0)
    rate = offered_rate([a.time_s for a in docs.arrivals])
    assert len(docs.arrivals) == 55 and rate == pytest.approx(0.451, abs=0.001)
    assert rate_note(docs, rate) is None
    assert describe_schedule(docs).endswith("; offered 0.451 req/s against --rps 0.5")
    # results.md's sweep at 1 req/s: a sparser window after the first minute
    sweep = conv_schedule(shared_data, rps=1.0, trace_offset_s=60.0, duration_s=120.0)
    note = rate_note(sweep, offered_rate([a.time_s for a in sweep.arrivals]))
    assert note is not None and note.startswith("offered 0.837 req/s against --rps 1: the 120 s window")
    assert "seconds 60.2-81.7" in note and "average of the file after --trace-offset" in note
    # one arrival in the window: no rate at all
    lone = conv_schedule(shared_data, rps=0.25, duration_s=60.0)
    assert len(lone.arrivals) == 1
    assert rate_note(lone, None) == (
        "offered no rate against --rps 0.25: 1 request(s) in the window, a rate needs two at different "
        "times (a longer --duration or another --trace-offset)"
    )
    # --speedup: the target is the trace's rate times the speed-up; --max-requests names the window
    fast = conv_schedule(shared_data, speedup=2.0, max_requests=50)
    note = rate_note(fast, offered_rate([a.time_s for a in fast.arrivals]))
    assert note is not None and note.startswith("offered 3.7 req/s against --speedup 2 (11.1 req/s): ")
    assert "the first 50 arrivals (--max-requests) cover seconds 0.0-26.5" in note


def test_rate_note_poisson_and_late_sends() -> None:
    few = poisson_schedule(1.0, 10.0, None, seed=0)
    n = len(few.arrivals)
    rate = offered_rate([a.time_s for a in few.arrivals])
    assert rate is not None and abs(rate - 1.0) > 0.1  # seed 0: 11 arrivals at 1.14 req/s
    assert rate_note(few, rate) == (
        f"offered {rate:.3g} req/s against --rps 1: a Poisson sample of {n} arrivals, whose rate varies "
        f"by about +-{100 / (n - 1) ** 0.5:.0f}% around the target; a longer --duration comes closer"
    )
    even = Schedule([Arrival(i, i * 0.5, None, None) for i in range(9)], "poisson", 2.0, "--rps 2")
    assert rate_note(even, 2.0, sent_rps=1.95) is None
    note = rate_note(even, 2.0, sent_rps=1.6, max_send_lag_ms=900.0)
    assert note == (
        "offered 1.6 req/s against --rps 2: the sends strayed from their schedule (up to 900 ms late): "
        "sent at 1.6 req/s against 2 req/s scheduled"
    )


def test_summary_states_target_sent_rate_and_note() -> None:
    records = [rec(i) for i in range(5)]
    records[4].sent_s = 4.0  # scheduled at 2.0
    s = summarize(records, duration_s=5.0, settings={"rps": 1.0})
    assert s.offered_rps == pytest.approx(2.0) and s.sent_rps == pytest.approx(1.0, abs=0.001)
    s.target_rps, s.rate_note = 1.0, "offered 2 req/s against --rps 1: because"
    js = s.to_json()
    assert js["target_rps"] == 1.0 and js["sent_rps"] == pytest.approx(1.0, abs=0.001)
    assert js["rate_note"] == s.rate_note
    buf = io.StringIO()
    render(s, make_console(file=buf))
    lines = buf.getvalue().splitlines()
    assert "offered 2 req/s against --rps 1: because" in lines
    assert any("target rate (req/s)" in ln and "1.000" in ln for ln in lines)
    assert any("sent rate (req/s)" in ln and "1.000" in ln for ln in lines)
