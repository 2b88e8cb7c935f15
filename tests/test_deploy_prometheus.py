"""The Prometheus rules and the Grafana dashboard against a real Prometheus scraping a real server.

Starts ``moeserve serve`` on a tiny checkpoint (half the experts in the buffer, an emulated slow
link so lookups miss and block, prefetching and an online EAMC so every panel has data) and
Debian's ``prometheus`` binary (1 s scrapes and rule evaluations, ``deploy/prometheus/rules/*.yml``
loaded), replays a few dozen completions, then checks:

* the hit-rate, blocking-per-token, prefetch-precision, CPU-share and prefix-cache recording
  rules, read back through ``/api/v1/query``, equal the ratios of the server's own counters
  between two ``/metrics`` scrapes (before/after the load);
* every rule loaded and evaluates without error, and no alert fires on the healthy server;
* every PromQL expression of the Grafana dashboard parses, evaluates, and returns numbers.

NOTE: why the comparison can be exact. ``rate()`` extrapolates each counter to the window edges,
with factors that depend only on sample timestamps, except that it never extrapolates below
zero. Prometheus starts while the server is idle, so every counter's first sample is 0 (no
extrapolation before it), all series of the target share timestamps, and the whole run fits in
the rules' 1m windows: the ratio of two rates is then exactly the ratio of the two increases.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

yaml = pytest.importorskip("yaml")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "moeserve.json"
PROMETHEUS = shutil.which("prometheus")
WINDOW_S = 60.0  # the recording rules' rate window: the run must fit inside it (see NOTE)

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="needs the prometheus binary (apt-get install -y prometheus)"
    ),
]

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Question: What is the capital of France? Answer:",
    "A Mixture-of-Experts layer routes each token",
    "To be, or not to be,",
    "class Stack:\n    def push(self, x):",
    "experts live in host memory",
    "The lazy dog",
]

Samples = dict[tuple[str, frozenset], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> Samples:
    """``/metrics`` text -> {(sample name, frozenset(labels)): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


class Proc:
    """A child process in its own session, logging to a file, stopped by its own pid."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._fh = log.open("wb")
        self.p = subprocess.Popen(
            args, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=ROOT
        )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def check_alive(self, what: str) -> None:
        if self.p.poll() is not None:
            pytest.fail(f"{what} exited with {self.p.returncode}:\n{self.tail()}")

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=5)
        self._fh.close()


def wait_until(what: str, check, timeout: float, procs: list[Proc], interval: float = 0.2):
    """Poll ``check()`` until it returns a truthy value (returned), failing after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        for proc in procs:
            proc.check_alive(proc.log.stem)
        try:
            last = check()
            if last:
                return last
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(interval)
    logs = "\n".join(f"--- {p.log.name}\n{p.tail()}" for p in procs)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})\n{logs}")


@dataclass
class Stack:
    server: str
    prom: str
    prom_started: float  # time.monotonic() when Prometheus was started
    before: Samples
    after: Samples
    metrics_text: str

    def query(self, expr: str) -> dict:
        r = httpx.get(f"{self.prom}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, r.status_code, body)
        return body["data"]

    def values(self, expr: str) -> list[float]:
        return [float(r["value"][1]) for r in self.query(expr)["result"]]

    def scalar(self, expr: str) -> float:
        values = self.values(expr)
        assert len(values) == 1, (expr, values)
        return values[0]

    def delta(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)


async def replay(url: str, model: str, n: int, concurrency: int) -> list[int]:
    """``n`` small greedy completions, ``concurrency`` at a time; returns the status codes."""
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4 + (i * 5) % 13}
        body["temperature"] = 0
        async with sem:
            r = await client.post(f"{url}/v1/completions", json=body, timeout=60)
            return r.status_code

    async with httpx.AsyncClient() as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(n))))


@pytest.fixture(scope="module")
def stack(tiny_qwen3: Path, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("deploy_prom")
    port, prom_port = free_port(), free_port()
    server = f"http://127.0.0.1:{port}"
    prom = f"http://127.0.0.1:{prom_port}"
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(tiny_qwen3)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    cmd += ["--buffer-fraction", "0.5", "--link-gbps", "0.5", "--log-level", "warning"]
    # next-layer-all always prefetches (the eam policy's gate may rightly find that planning costs
    # more than it saves on this tiny model); the eam-reuse cache keeps the tracer and its EAMC
    cmd += ["--prefetch-policy", "next-layer-all", "--cache-policy", "eam-reuse"]
    cmd += ["--eamc-path", str(tmp / "eamc")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[Proc] = []
    try:
        procs.append(Proc(cmd, tmp / "moeserve.log", env))
        wait_until("moeserve /health", lambda: httpx.get(f"{server}/health").status_code == 200, 60, procs)

        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES / "recording.yml"), str(RULES / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "moeserve", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_started = time.monotonic()
        prom_cmd = [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}"]
        prom_cmd += [f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
        procs.append(Proc(prom_cmd, tmp / "prometheus.log"))
        wait_until("Prometheus ready", lambda: httpx.get(f"{prom}/-/ready").status_code == 200, 30, procs)

        def first_scrape() -> bool:
            r = httpx.get(f"{prom}/api/v1/query", params={"query": 'up{job="moeserve"} == 1'}).json()
            return bool(r["data"]["result"])

        wait_until("the first scrape of moeserve", first_scrape, 20, procs)
        before = parse_metrics(httpx.get(f"{server}/metrics").text)

        codes = asyncio.run(replay(server, "tiny", n=36, concurrency=4))
        assert codes == [200] * len(codes), codes
        text = httpx.get(f"{server}/metrics").text
        after = parse_metrics(text)
        st = Stack(server, prom, prom_started, before, after, text)

        # Wait until Prometheus scraped the final counters, then for a rule evaluation after that.
        tokens = total(after, "moeserve_generation_tokens_total")
        wait_until(
            "Prometheus to scrape the final counters",
            lambda: st.values("moeserve_generation_tokens_total") == [tokens],
            15,
            procs,
        )
        scraped_at = st.scalar("timestamp(moeserve_generation_tokens_total)")

        def evaluated_after_scrape() -> bool:  # one evaluation interval later, to be safe
            stamps = st.values("timestamp(instance:moeserve_expert_hit_rate:ratio_rate1m)")
            return bool(stamps) and stamps[0] > scraped_at + 1

        wait_until("a rule evaluation after that scrape", evaluated_after_scrape, 15, procs)
        yield st
    finally:
        for proc in reversed(procs):
            proc.stop()


def assert_fresh(stack: Stack) -> None:
    elapsed = time.monotonic() - stack.prom_started
    assert elapsed < WINDOW_S - 5, f"run took {elapsed:.0f} s: the 1m windows no longer see the first sample"


def test_hit_rate_rules_match_server_counters(stack: Stack) -> None:
    assert_fresh(stack)
    lookups = stack.delta("moeserve_expert_lookups_total")
    hits = stack.delta("moeserve_expert_hits_total")
    assert lookups > 0 and 0 < hits < lookups, "the load must produce both hits and misses"
    # The per-device family counts the same lookups, in a family of its own.
    assert stack.delta("moeserve_device_expert_lookups_total") == lookups
    expected = hits / lookups
    for rule in (
        "instance:moeserve_expert_hit_rate:ratio_rate1m",
        "job:moeserve_expert_hit_rate:ratio_rate1m",
    ):
        assert stack.scalar(rule) == pytest.approx(expected, rel=1e-9), rule

    layers = {dict(ls)["layer"] for (n, ls) in stack.after if n == "moeserve_expert_lookups_total"}
    assert len(layers) == 2  # the tiny checkpoint's two MoE layers
    for layer in sorted(layers):
        want = stack.delta("moeserve_expert_hits_total", layer=layer) / stack.delta(
            "moeserve_expert_lookups_total", layer=layer
        )
        got = stack.scalar(f'job_layer:moeserve_expert_hit_rate:ratio_rate1m{{layer="{layer}"}}')
        assert got == pytest.approx(want, rel=1e-9), layer

    want = stack.delta("moeserve_device_expert_hits_total", device="0") / stack.delta(
        "moeserve_device_expert_lookups_total", device="0"
    )
    got = stack.scalar('job_device:moeserve_expert_hit_rate:ratio_rate1m{device="0"}')
    assert got == pytest.approx(want, rel=1e-9)


def test_blocking_per_token_rules_match_server_counters(stack: Stack) -> None:
    assert_fresh(stack)
    blocked = stack.delta("moeserve_expert_blocking_seconds_total")
    assert stack.delta("moeserve_device_expert_blocking_seconds_total") == pytest.approx(blocked)
    tokens = stack.delta("moeserve_generation_tokens_total")
    assert blocked > 0 and tokens > 0, "the emulated slow link must make lookups block"
    for rule in (
        "instance:moeserve_expert_blocking_seconds_per_output_token:ratio_rate1m",
        "job:moeserve_expert_blocking_seconds_per_output_token:ratio_rate1m",
    ):
        assert stack.scalar(rule) == pytest.approx(blocked / tokens, rel=1e-9), rule


def test_prefetch_precision_rule_matches_server_counters(stack: Stack) -> None:
    assert_fresh(stack)
    issued = stack.delta("moeserve_prefetch_issued_total")
    used = stack.delta("moeserve_prefetch_used_total")
    assert issued > 0, "EAM prefetching must issue prefetches"
    got = stack.scalar("job:moeserve_prefetch_precision:ratio_rate5m")
    assert got == pytest.approx(used / issued, rel=1e-9)


def test_hybrid_and_prefix_cache_rules_match_server_counters(stack: Stack) -> None:
    """The share of misses computed on the CPU (``--expert-compute auto``, the default over the
    emulated link; the tiny model's copies are cheap, so the share may be 0) and the prefix
    cache's hit rate (each prompt is sent several times)."""
    assert_fresh(stack)
    misses = stack.delta("moeserve_expert_lookups_total") - stack.delta("moeserve_expert_hits_total")
    cpu = stack.delta("moeserve_expert_cpu_runs_total")
    assert misses > 0 and 0 <= cpu <= misses
    for rule in (
        "instance:moeserve_expert_cpu_runs_per_miss:ratio_rate1m",
        "job:moeserve_expert_cpu_runs_per_miss:ratio_rate1m",
    ):
        assert stack.scalar(rule) == pytest.approx(cpu / misses, rel=1e-9, abs=1e-12), rule
    queries = stack.delta("moeserve_prefix_cache_queries_total")
    hits = stack.delta("moeserve_prefix_cache_hits_total")
    print(f"CPU runs {cpu:g} of {misses:g} misses; prefix cache hits {hits:g} of {queries:g} tokens")
    assert 0 < hits < queries  # a repeated prompt reuses its full blocks, never its last token
    got = stack.scalar("job:moeserve_prefix_cache_hit_rate:ratio_rate5m")
    assert got == pytest.approx(hits / queries, rel=1e-9, abs=1e-12)


def test_all_rules_load_and_evaluate_and_nothing_fires(stack: Stack) -> None:
    groups = httpx.get(f"{stack.prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {(g["name"], r["name"]) for g in groups for r in g["rules"]}
    expected = set()
    for path in (RULES / "recording.yml", RULES / "alerts.yml"):
        for g in yaml.safe_load(path.read_text())["groups"]:
            expected |= {(g["name"], r.get("record") or r["alert"]) for r in g["rules"]}
    assert loaded == expected
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not bad, bad
    firing = [a for a in stack.query("ALERTS")["result"] if a["metric"]["alertstate"] == "firing"]
    assert not firing, firing


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every dashboard target, Grafana variables filled in."""
    subst = {"$__rate_interval": "1m", "$__interval": "1s", "$job": "moeserve", "$instance": ".*"}
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in subst.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unhandled variable in {panel['title']!r}: {expr}"
            out.append((panel["title"], expr))
    return out


def test_dashboard_queries_evaluate_with_data(stack: Stack) -> None:
    assert_fresh(stack)
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    for title, expr in exprs:
        data = stack.query(expr)  # asserts HTTP 200 + status success: the expression parsed
        assert data["result"], f"panel {title!r}: no data for {expr}"
        values = [float(r["value"][1]) for r in data["result"]]
        assert all(not math.isnan(v) for v in values), (title, expr, values)
