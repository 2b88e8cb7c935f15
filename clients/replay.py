"""Replay request arrivals against a running server and report what it did (MoE-Infinity §7.1).

A run: build the request schedule, wait for the server's ``/health`` (``--wait-s``,
``clients/ready.py``), ask ``/v1/models`` for the model name and context length (a run never
guesses a model name: no listed model, no run), pick how prompt tokens are
measured (``clients/sizing.py``: the server's ``/tokenize``, else a calibration probe), build the
request schedule (trace or Poisson arrivals, prompts from the task mix fitted to each row's length
and cut to the context), scrape
``/metrics``, send every request at its time on one ``httpx.AsyncClient`` (streaming), scrape
``/metrics`` again, then summarise and write the records and the summary to ``config.out``. The
summary gives the rate offered (scheduled and sent) against the target, and says why when they
differ by more than 10% (:func:`clients.trace.rate_note`).

A failed request (unreachable server, 4xx, 5xx, timeout, broken stream) is a record with an error
status, never an exception that ends the run.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from clients.http import RequestRecord, RequestSpec, get_text, stream_completion
from clients.metrics_scrape import MetricsSnapshot, ServerDelta, diff, parse_metrics
from clients.options import DEFAULT_MAX_CONTEXT, ReplayConfig
from clients.plots import plot_run
from clients.prompts import (
    DEFAULT_CHARS_PER_TOKEN,
    CharEstimate,
    HFTokenizer,
    PromptRecord,
    PromptSampler,
    TokenCounter,
    load_prompts,
)
from clients.ready import served_model, wait_until_ready
from clients.report import Summary, render, summarize
from clients.sizing import choose_counter
from clients.trace import (
    Arrival,
    Schedule,
    load_azure_trace,
    offered_rate,
    poisson_schedule,
    rate_note,
    trace_schedule,
)
from richconsole import make_console

# Tokens kept free of the context budget for special tokens and re-tokenisation at the cut.
CONTEXT_MARGIN = 8


def build_requests(
    cfg: ReplayConfig,
    arrivals: list[Arrival],
    prompts: list[PromptRecord],
    max_context: int,
    counter: TokenCounter | None = None,
) -> list[RequestSpec]:
    """Fit prompts and output lengths to each arrival.

    ``max_tokens = min(GeneratedTokens, max_tokens_cap)`` (``max_tokens_cap`` without a trace, at
    least 1); the prompt aims at ``min(ContextTokens, max_context - max_tokens - CONTEXT_MARGIN)``
    tokens (at least 1), or is one prompt as drawn without a trace, cut to that budget. A spec whose
    trace length or drawn prompt did not fit has ``cut=True``. ``counter`` measures tokens
    (default: ``--tokenizer``, else ``--chars-per-token``, else 4 characters per token).
    """
    if counter is None:
        per_token = cfg.chars_per_token or DEFAULT_CHARS_PER_TOKEN
        counter = HFTokenizer(cfg.tokenizer) if cfg.tokenizer else CharEstimate(per_token)
    sampler = PromptSampler(prompts, counter, seed=cfg.seed)
    specs: list[RequestSpec] = []
    for a in arrivals:
        gen = cfg.max_tokens_cap if a.generated_tokens is None else a.generated_tokens
        max_tokens = max(1, min(gen, cfg.max_tokens_cap, max_context - 1 - CONTEXT_MARGIN))
        budget = max(1, max_context - max_tokens - CONTEXT_MARGIN)
        target = None if a.context_tokens is None else max(1, min(a.context_tokens, budget))
        p = sampler.sample(target)
        cut = a.context_tokens is not None and a.context_tokens > budget
        if target is None and p.est_tokens > budget:
            p, cut = sampler.fit(p, budget), True
        specs.append(
            RequestSpec(
                index=a.index,
                scheduled_s=a.time_s,
                prompt=p.text,
                max_tokens=max_tokens,
                dataset=p.dataset,
                task=p.task,
                target_prompt_tokens=p.est_tokens,
                trace_context_tokens=a.context_tokens,
                trace_generated_tokens=a.generated_tokens,
                cut=cut,
            )
        )
    return specs


def schedule_for(cfg: ReplayConfig) -> Schedule:
    """The schedule of a run: scaled trace rows in the window, or Poisson arrivals (needs no server)."""
    if cfg.trace is None:
        assert cfg.rps is not None  # checked by ReplayConfig
        return poisson_schedule(cfg.rps, cfg.duration_s, cfg.max_requests, cfg.seed)
    return trace_schedule(
        load_azure_trace(cfg.trace),
        cfg.trace.name,
        cfg.rps,
        cfg.speedup,
        cfg.trace_offset_s,
        cfg.duration_s,
        cfg.max_requests,
    )


def arrivals_for(cfg: ReplayConfig) -> list[Arrival]:
    """The arrivals of :func:`schedule_for`."""
    return schedule_for(cfg).arrivals


def describe_schedule(schedule: Schedule) -> str:
    """One line: how many requests over how long, the rate offered against the target and, when
    they differ by more than 10%, why (:func:`clients.trace.rate_note`)."""
    times = [a.time_s for a in schedule.arrivals]
    span = max(times) - min(times) if times else 0.0
    rate = offered_rate(times)
    head = f"schedule: {len(times)} requests over {span:.1f} s; "
    note = rate_note(schedule, rate)
    if note is not None:
        return head + note
    shown = "no rate" if rate is None else f"{rate:.3g} req/s"
    return head + f"offered {shown} against {schedule.target_label}"


async def _scrape(client: httpx.AsyncClient, url: str) -> tuple[MetricsSnapshot | None, str | None]:
    text = await get_text(client, url, "/metrics")
    if text is None:
        return None, None
    try:
        return parse_metrics(text), text
    except ValueError:
        return None, text


async def send_all(
    client: httpx.AsyncClient,
    cfg: ReplayConfig,
    specs: list[RequestSpec],
    model: str,
    console: Console,
) -> tuple[list[RequestRecord], float]:
    """Send each request at its ``scheduled_s`` and wait for all answers.

    Returns:
        records in schedule order, and the wall time from the run start to the last answer, s.
    """
    progress = Progress(
        TextColumn("[bold]replay[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("sent {task.fields[sent]}  failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not cfg.progress,
    )
    failed = 0
    with progress:
        bar = progress.add_task("replay", total=len(specs), sent=0, failed=0)

        def _done(task: asyncio.Task[RequestRecord]) -> None:
            nonlocal failed
            if task.cancelled() or task.exception() is not None or not task.result().ok:
                failed += 1
            progress.update(bar, advance=1, failed=failed)

        tasks: list[asyncio.Task[RequestRecord]] = []
        run_start = time.perf_counter()
        for spec in specs:
            delay = spec.scheduled_s - (time.perf_counter() - run_start)
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(
                stream_completion(client, cfg.url, spec, model, run_start, cfg.ignore_eos)
            )
            t.add_done_callback(_done)
            tasks.append(t)
            progress.update(bar, sent=len(tasks))
        records = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - run_start
    return records, wall


async def _scrape_after(
    client: httpx.AsyncClient, url: str, before: MetricsSnapshot | None, succeeded: int
) -> tuple[MetricsSnapshot | None, str | None]:
    """Scrape again until the server's finished-request count covers the run (at most ~1 s).

    The server counts a request when its engine step ends, which can land a moment after the
    client read ``[DONE]``.
    """
    for _ in range(20):
        after, text = await _scrape(client, url)
        if after is None or before is None:
            return after, text
        done = diff(before, after).requests_success
        if done is None or done >= succeeded:
            return after, text
        await asyncio.sleep(0.05)
    return after, text


def write_outputs(
    out: Path, records: list[RequestRecord], summary: Summary, scrapes: dict[str, str | None], title: str
) -> Path | None:
    """``requests.jsonl``, ``summary.json``, ``summary.txt``, the raw scrapes and the run plot."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n", encoding="utf-8")
    for name, text in scrapes.items():
        if text is not None:
            (out / name).write_text(text, encoding="utf-8")
    text_console = make_console(record=True, file=io.StringIO())
    render(summary, text_console)
    (out / "summary.txt").write_text(text_console.export_text(), encoding="utf-8")
    return plot_run(records, out, title)


async def run_async(cfg: ReplayConfig, console: Console | None = None) -> Summary:
    """Run one replay (see the module docstring); writes its files to ``cfg.out``."""
    console = console or make_console(stderr=True)
    schedule = schedule_for(cfg)  # bad input files fail here, before any request
    arrivals = schedule.arrivals
    prompts = load_prompts(cfg.prompts)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        waited = await wait_until_ready(client, cfg.url, cfg.wait_s)
        if waited >= 1.0:
            console.print(f"server at {cfg.url} ready after {waited:.1f} s")
        served = await served_model(client, cfg.url, cfg.model)
        model = served.id
        max_context = cfg.max_context or served.max_model_len
        if max_context is None:
            max_context = DEFAULT_MAX_CONTEXT
            console.print(
                f"[yellow]warning[/yellow]: {cfg.url}/v1/models states no max_model_len for {model!r}; "
                f"prompts are sized for {DEFAULT_MAX_CONTEXT} tokens (--max-context to set it)"
            )
        console.print(describe_schedule(schedule), markup=False, soft_wrap=True)
        with httpx.Client(timeout=timeout, trust_env=False) as sync_client:
            sizing = await asyncio.to_thread(choose_counter, cfg, sync_client, model, prompts, max_context)
            specs = await asyncio.to_thread(
                build_requests, cfg, arrivals, prompts, max_context, sizing.counter
            )
        before, before_text = await _scrape(client, cfg.url)
        records, wall = await send_all(client, cfg, specs, model, console)
        after, after_text = await _scrape_after(client, cfg.url, before, sum(r.ok for r in records))
    server: ServerDelta | None = diff(before, after) if before and after else None
    settings = cfg.settings() | {
        "model": model,
        "max_context": max_context,
        "prompt_length": sizing.how,
        "prompts_cut": sum(s.cut for s in specs),
    }
    summary = summarize(records, wall, settings, cfg.slo_tpot_ms, server)
    summary.target_rps = schedule.target_rps
    summary.rate_note = rate_note(schedule, summary.offered_rps, summary.sent_rps, summary.max_send_lag_ms)
    rate = f"{cfg.rps:g} req/s" if cfg.rps else f"speedup {cfg.speedup or 1:g}"
    scrapes = {"metrics_before.prom": before_text, "metrics_after.prom": after_text}
    assert cfg.out is not None  # ReplayConfig fills in a default
    out = cfg.out
    png = write_outputs(out, records, summary, scrapes, f"{settings['trace']} at {rate}, {model} @ {cfg.url}")
    render(summary, console)
    console.print(f"records: {out / 'requests.jsonl'}  summary: {out / 'summary.json'}  plot: {png}")
    return summary


def replay(cfg: ReplayConfig, console: Console | None = None) -> Summary:
    """Blocking wrapper of :func:`run_async`."""
    return asyncio.run(run_async(cfg, console))
