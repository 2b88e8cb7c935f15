"""Replay client against the real ``moeserve serve`` (tiny Qwen3-MoE checkpoint) on loopback.

The server runs in a subprocess with half the experts in the buffer and an emulated link, so hits,
misses and blocking time are all non-trivial. Checks: the report's counts equal the server's
counters, sends follow the trace schedule, real 4xx answers are reported, and a replay started
right after the server waits for it.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clients.options import ReplayConfig
from clients.ready import ServerUnavailable
from clients.replay import replay

pytestmark = pytest.mark.skipif(importlib.util.find_spec("server.app") is None, reason="server not present")

# 16 arrivals over 1.5 s with bursts and gaps; lengths within the tiny model's 256-token context
TIMES = [0.0, 0.02, 0.03, 0.2, 0.25, 0.26, 0.27, 0.5, 0.55, 0.8, 0.81, 0.82, 1.0, 1.2, 1.45, 1.5]
LENGTHS = [(40, 6), (90, 3), (20, 8), (150, 2), (60, 5), (30, 7), (10, 1), (70, 4)] * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tiny_qwen3: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``moeserve serve`` on a free port in a subprocess (not waited for)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "moeserve",
        "serve",
        "--model",
        str(tiny_qwen3),
        "--port",
        str(port),
        "--buffer-fraction",
        "0.5",
        "--link-gbps",
        "1",
        "--log-level",
        "warning",
    ]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server_url(tiny_qwen3: Path, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("srv") / "server.log"
    proc, url = start_server(tiny_qwen3, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not become healthy in 90 s: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        stop_server(proc)


def write_trace(path: Path, times: list[float], lengths: list[tuple[int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, (ctx, gen) in zip(times, lengths):
        sec = 46 + t
        lines.append(f"2023-11-16 18:15:{int(sec):02d}.{round((sec % 1) * 1e7):07d},{ctx},{gen}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def prompts(tmp_path: Path, shared_data: Path) -> Path:
    return shared_data / "prompts" / "prompts_combined.jsonl"


def test_counts_match_server_counters(server_url, tiny_qwen3, prompts, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv", TIMES, LENGTHS)
    cfg = ReplayConfig(
        url=server_url,
        prompts=prompts,
        trace=trace,
        tokenizer=tiny_qwen3,
        ignore_eos=True,
        out=tmp_path / "run",
        progress=False,
        slo_tpot_ms=500.0,
    )
    s = replay(cfg)
    recs = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert s.errors == {} and s.succeeded == len(TIMES)
    # the report's counts are the server's counts over the run
    assert s.server is not None
    assert s.server.requests_success == s.succeeded
    assert s.server.success_by_reason["length"] == Counter(r["finish_reason"] for r in recs)["length"]
    assert s.server.generation_tokens == s.output_tokens == sum(g for _, g in LENGTHS)
    assert s.server.prompt_tokens == s.prompt_tokens
    assert s.server.expert_lookups > 0 and 0.0 < s.server.hit_rate < 1.0 and s.server.blocking_s > 0
    hits = sum(r["expert_stats"]["buffer_hits"] for r in recs)
    misses = sum(r["expert_stats"]["buffer_misses"] for r in recs)
    # usage.expert_stats charges a lookup to every request in the batch that routed to the expert;
    # the server's counters count it once per step, so the per-request sums are at least as large
    assert hits + misses >= s.server.expert_lookups and hits >= s.server.expert_hits
    # prompts were sized with the server's tokenizer: the server saw about the trace's length
    for r, (ctx, _) in zip(recs, LENGTHS):
        assert abs(r["prompt_tokens"] - ctx) <= 3
    # sends follow the trace schedule
    assert [r["scheduled_s"] for r in recs] == pytest.approx(TIMES, abs=1e-6)
    assert all(abs(r["sent_s"] - r["scheduled_s"]) < 0.2 for r in recs)
    assert s.ttft.count == len(TIMES) and s.tpot.count == sum(1 for _, g in LENGTHS if g > 1)


def test_replay_right_after_serve_waits_for_it(tiny_qwen3, prompts, tmp_path: Path) -> None:
    """``moeserve serve ... &`` then ``moeserve replay`` at once: the replay waits for the model to
    load and asks for the model the server lists, so no request fails."""
    proc, url = start_server(tiny_qwen3, tmp_path / "server.log")
    try:
        trace = write_trace(tmp_path / "t.csv", [0.0, 0.1, 0.2], [(20, 2), (30, 3), (40, 2)])
        with pytest.raises(httpx.ConnectError):  # still importing torch, loading the model
            httpx.get(f"{url}/health", timeout=1.0, trust_env=False)
        out = tmp_path / "run"
        s = replay(ReplayConfig(url=url, prompts=prompts, trace=trace, out=out, progress=False, wait_s=90))
    finally:
        stop_server(proc)
    assert s.errors == {} and s.succeeded == 3
    assert s.settings["model"] == tiny_qwen3.name and s.settings["max_context"] == 256


def test_real_4xx_is_reported(server_url, tiny_qwen3, prompts, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.05], [(20, 2), (20, 2)])
    # a model the server does not serve: refused before any request, never sent
    match = f"--model 'no-such-model' is not served: .* lists {tiny_qwen3.name}"
    with pytest.raises(ServerUnavailable, match=match):
        replay(
            ReplayConfig(
                url=server_url,
                prompts=prompts,
                trace=trace,
                model="no-such-model",
                out=tmp_path / "a",
                progress=False,
            )
        )
    # a prompt longer than the server's context (client told a larger one): a 400, run goes on
    trace = write_trace(tmp_path / "t2.csv", [0.0, 0.05], [(600, 2), (20, 2)])
    s = replay(
        ReplayConfig(
            url=server_url,
            prompts=prompts,
            trace=trace,
            tokenizer=tiny_qwen3,
            max_context=2048,
            out=tmp_path / "b",
            progress=False,
        )
    )
    assert s.errors == {"http_error 400": 1} and s.succeeded == 1
    rec = json.loads((tmp_path / "b" / "requests.jsonl").read_text().splitlines()[0])
    assert rec["http_status"] == 400 and rec["error"].startswith("HTTP 400: ")
