"""``moeserve bench kv``: the static KV layout against the paged one at equal KV memory.

A scheduler-level replay (no model runs): requests with a trace's prompt and output lengths
(``ContextTokens``, ``GeneratedTokens``; the Azure LLM inference trace's conversation file by
default) arrive as a Poisson process at ``--rate`` and go through the runtime's own
:class:`~moe_runtime.engine.scheduler.Scheduler` with

* the **static** layout's admission rule (:class:`StaticRows`): one row of ``--max-model-len``
  positions per running sequence, reserved from admission to finish, as many rows as the memory
  holds (the layout moeserve had before its paged cache; the rows are also the batch size);
* the **paged** cache's :class:`~moe_runtime.engine.kv_manager.KVCacheManager`: blocks of
  ``--block-size`` positions from a pool of the same memory, admission by free blocks, preemption
  by recompute when they run out (prefix caching off: a trace has lengths, not tokens).

A step's time is a model, not a measurement: ``--step-ms`` plus ``--token-us`` per token the step
computes (both printed with the figures). Per layout and seed: the admitted concurrency (running
sequences, time-weighted, from the arrival of the ``--warmup``-th request to the last arrival),
its maximum, preemptions, and TTFT (arrival to first token) p50 and p90 of the requests after the
warm-up. Each repeat samples ``--requests`` requests from the trace and their arrivals with its own
seed; the report gives the median and the range over the repeats, and the paged/static
concurrency ratio.

``--prefix-chat`` measures prefix caching on a live server instead (:mod:`moeserve.bench.kv_prefix`).
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_runtime.engine.kv_manager import KVCacheManager
from moe_runtime.engine.request import SamplingParams, Sequence
from moe_runtime.engine.scheduler import Scheduler
from moe_runtime.layers.kv_cache import cdiv
from moeserve.bench.kv_prefix import _spread

DEFAULT_TRACE = Path("../shared/data/arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")


class StaticRows:
    """The static layout's admission rule, for the scheduler: a sequence takes one of ``rows``
    rows of ``max_len`` positions when admitted and holds it until it finishes; it never grows,
    so nothing is ever preempted. ``num_blocks``/``num_free`` count positions in blocks, for
    comparison with the paged pool."""

    enable_caching = False

    def __init__(self, rows: int, max_len: int, block_size: int) -> None:
        self.rows, self.per_row = rows, cdiv(max_len, block_size)
        self.held: set[str] = set()
        self.queries = self.hits = 0

    @property
    def num_blocks(self) -> int:
        return self.rows * self.per_row

    @property
    def num_free(self) -> int:
        return (self.rows - len(self.held)) * self.per_row

    def allocate(self, seq: Sequence, num_new: int, hit=None) -> bool:
        if seq.request_id in self.held:
            return True
        if len(self.held) == self.rows:
            return False
        self.held.add(seq.request_id)
        return True

    def free(self, seq: Sequence) -> None:
        self.held.discard(seq.request_id)

    def find_cached(self, seq: Sequence) -> None:
        return None

    def cache_computed(self, seq: Sequence) -> None:
        return None

    def record_lookup(self, seq: Sequence, hit) -> None:
        return None


@dataclass(frozen=True)
class Settings:
    max_model_len: int
    block_size: int
    kv_tokens: int
    max_batch_size: int
    max_num_batched_tokens: int
    requests: int
    rate: float
    warmup: int
    step_ms: float
    token_us: float


def read_lengths(path: Path) -> np.ndarray:
    """``[n, 2]`` int64 (prompt, output) tokens per request of a trace CSV (``ContextTokens``,
    ``GeneratedTokens``; an output of 0 counts as 1)."""
    with open(path, newline="") as f:
        rows = [(int(r["ContextTokens"]), max(1, int(r["GeneratedTokens"]))) for r in csv.DictReader(f)]
    return np.asarray(rows, dtype=np.int64)


def replay(lengths: np.ndarray, layout: str, s: Settings, seed: int) -> dict:
    """One run of ``layout`` (``static`` or ``paged``) over ``s.requests`` requests sampled from
    ``lengths`` with ``seed``; returns the run's figures."""
    rng = np.random.default_rng(seed)
    fit = lengths[lengths.sum(axis=1) <= s.max_model_len]
    picked = fit[rng.choice(len(fit), size=s.requests, replace=len(fit) < s.requests)]
    arrivals = np.cumsum(rng.exponential(1.0 / s.rate, size=s.requests))
    if layout == "static":
        rows = s.kv_tokens // s.max_model_len
        kv = StaticRows(rows, s.max_model_len, s.block_size)
        sched = Scheduler(rows, s.max_num_batched_tokens, kv)  # type: ignore[arg-type]
    else:
        kv = KVCacheManager(s.kv_tokens // s.block_size, s.block_size, enable_caching=False)
        sched = Scheduler(s.max_batch_size, s.max_num_batched_tokens, kv)
    seqs = []
    for i, (prompt, out) in enumerate(picked):
        params = SamplingParams(max_tokens=int(out), temperature=0, ignore_eos=True)
        seqs.append(Sequence(str(i), [0] * int(prompt), params, arrival_time=float(arrivals[i])))
    t, nxt, finished = 0.0, 0, 0
    start, end = float(arrivals[min(s.warmup, s.requests - 1)]), float(arrivals[-1])
    busy = peak = 0.0
    while finished < s.requests:
        while nxt < s.requests and arrivals[nxt] <= t:
            sched.add(seqs[nxt])
            nxt += 1
        if not sched.has_unfinished():
            t = float(arrivals[nxt])
            continue
        scheduled = sched.schedule()
        tokens = sum(x.num_new for x in scheduled)
        dt = (s.step_ms + s.token_us * tokens / 1000.0) / 1000.0
        running = len(sched.running)
        lo, hi = max(t, start), min(t + dt, end)
        if hi > lo:
            busy += running * (hi - lo)
            peak = max(peak, running)
        t += dt
        for x in scheduled:
            seq = x.seq
            seq.num_computed += x.num_new
            sched.computed(seq)
            if x.sample:
                seq.output_token_ids.append(0)
                if seq.first_token_time is None:
                    seq.first_token_time = t
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
                    finished += 1
    ttft = np.asarray([q.first_token_time - q.arrival_time for q in seqs[s.warmup :]])
    return {
        "concurrency": busy / (end - start) if end > start else 0.0,
        "max_concurrency": peak,
        "preemptions": sched.num_preemptions,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "makespan_s": t,
    }


def run(lengths: np.ndarray, s: Settings, seeds: list[int]) -> dict:
    """Both layouts on every seed: per layout, each figure's median and range over the seeds."""
    out: dict = {"settings": {**s.__dict__, "seeds": seeds}}
    runs = {layout: [replay(lengths, layout, s, seed) for seed in seeds] for layout in ("static", "paged")}
    for layout, rs in runs.items():
        out[layout] = {k: _spread([r[k] for r in rs]) for k in rs[0]}
    ratios = [p["concurrency"] / st["concurrency"] for p, st in zip(runs["paged"], runs["static"])]
    out["concurrency_ratio"] = _spread(ratios)
    out["static"]["rows"] = s.kv_tokens // s.max_model_len
    out["paged"]["blocks"] = s.kv_tokens // s.block_size
    return out


def _fmt(v: dict[str, float], fmt: str = ".1f") -> str:
    return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"


def render(result: dict) -> str:
    s = result["settings"]
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in s.items())]
    lines.append(
        f"{'layout':8} {'concurrency':>22} {'max':>6} {'preemptions':>18} {'TTFT p50 s':>22} {'p90 s':>22}"
    )
    for layout in ("static", "paged"):
        r = result[layout]
        lines.append(
            f"{layout:8} {_fmt(r['concurrency']):>22} {r['max_concurrency']['median']:>6.0f} "
            f"{_fmt(r['preemptions'], '.0f'):>18} {_fmt(r['ttft_p50_s'], '.2f'):>22} "
            f"{_fmt(r['ttft_p90_s'], '.2f'):>22}"
        )
    c = result["concurrency_ratio"]
    lines.append(f"paged / static concurrency: {c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f})")
    return "\n".join(lines)


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv", help="static vs paged KV cache at equal memory (scheduler replay); --prefix-chat"
    )
    p.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="CSV with ContextTokens, GeneratedTokens"
    )
    p.add_argument(
        "--max-model-len", type=int, default=16384, help="positions per static row (default 16384)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--static-rows", type=int, default=8, help="KV memory as static rows (default 8)")
    p.add_argument(
        "--max-batch-size", type=int, default=1024, help="paged layout's batch limit (default 1024)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--requests", type=int, default=2000, help="requests sampled per repeat (default 2000)")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="requests left out of the figures (default 10%%)")
    p.add_argument("--step-ms", type=float, default=20.0, help="modelled step time, fixed part (ms)")
    p.add_argument("--token-us", type=float, default=100.0, help="modelled step time per computed token (us)")
    p.add_argument("--repeats", type=int, default=3, help="seeds 0..n-1 (>= 3 for a spread)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--prefix-chat", action="store_true", help="measure prefix caching on a live server")
    p.add_argument("--system-tokens", type=int, default=1024, help="--prefix-chat: shared system prompt")
    p.add_argument(
        "--device",
        default="cpu",
        help="where --prefix-chat runs the bundled model (cpu, cuda); the replay runs no model, and with "
        "a device other than cpu the prefix chat runs after it on that device (the CUDA decode path)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.prefix_chat:
        return _prefix_chat(args)
    if args.repeats < 1 or args.requests < 2:
        raise SystemExit("moeserve bench kv: --repeats >= 1 and --requests >= 2")
    s = Settings(
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_tokens=args.static_rows * args.max_model_len,
        max_batch_size=args.max_batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        requests=args.requests,
        rate=args.rate,
        warmup=args.requests // 10 if args.warmup is None else args.warmup,
        step_ms=args.step_ms,
        token_us=args.token_us,
    )
    if not args.trace.is_file():
        raise SystemExit(
            f"moeserve bench kv: no trace at {args.trace} (--trace: a CSV with ContextTokens, "
            "GeneratedTokens)"
        )
    result = run(read_lengths(args.trace), s, list(range(args.repeats)))
    result["settings"]["trace"] = str(args.trace)
    chat = _prefix_result(args) if args.device != "cpu" else None
    if chat is not None:
        result["prefix_chat"] = chat
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
        if chat is not None:
            from moeserve.bench.kv_prefix import render as render_chat

            print(render_chat(chat))
    return 0


def _prefix_result(args: argparse.Namespace) -> dict:
    from moe_runtime.assets import default_model_dir
    from moe_runtime.config import RuntimeConfig
    from moeserve.bench.kv_prefix import run_prefix_chat

    dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    runtime = RuntimeConfig(
        device=args.device, dtype=dtype, max_batch_size=8, cpu_threads=1, block_size=args.block_size
    )
    return run_prefix_chat(default_model_dir(), runtime, args.system_tokens, repeats=args.repeats)


def _prefix_chat(args: argparse.Namespace) -> int:
    from moeserve.bench.kv_prefix import render as render_chat

    result = _prefix_result(args)
    print(json.dumps(result, indent=2) if args.json else render_chat(result))
    return 0


def markdown(data: dict | list[dict]) -> str:
    """Markdown of one or more ``bench kv --json`` documents (a generated docs block): the replays
    as one table, each layout's figures median (min-max) over the seeds, with the paged/static
    concurrency ratio per arrival rate; a ``--prefix-chat`` document as a paragraph.

    Raises:
        ValueError: no document holds a replay or a prefix chat.
    """
    from moeserve.bench.render import md_table

    docs = data if isinstance(data, list) else [data]
    replays = [d for d in docs if "paged" in d]
    chats = [d for d in docs if "first_ttft_ms" in d] + [
        d["prefix_chat"] for d in replays if "prefix_chat" in d
    ]
    if not replays and not chats:
        raise ValueError("no bench kv result in the data")
    out = []
    if replays:
        header = ["arrivals", "requests", "layout", "running requests", "max", "preemptions",
                  "TTFT p50 s", "TTFT p90 s"]  # fmt: skip
        rows, ratios = [], []
        for d in replays:
            s = d["settings"]
            for layout, size in (
                ("static", f"{d['static']['rows']} rows of {s['max_model_len']:,}"),
                ("paged", f"{d['paged']['blocks']:,} blocks of {s['block_size']}"),
            ):
                r = d[layout]
                rows.append([
                    f"{s['rate']:g}/s", f"{s['requests']:,} sampled", f"{layout} ({size})",
                    _fmt(r["concurrency"]), f"{r['max_concurrency']['median']:.0f}",
                    _fmt(r["preemptions"], ".0f"), _fmt(r["ttft_p50_s"], ".2f"), _fmt(r["ttft_p90_s"], ".2f"),
                ])  # fmt: skip
            c = d["concurrency_ratio"]
            ratios.append(f"{c['median']:.1f}x ({c['min']:.1f}-{c['max']:.1f}) at {s['rate']:g}/s")
        s = replays[0]["settings"]
        out += [
            md_table(header, rows).rstrip("\n"),
            "",
            f"Paged / static running requests: {', '.join(ratios)}. Modelled step: {s['step_ms']:g} ms + "
            f"{s['token_us']:g} us per computed token; {len(s['seeds'])} seeds; up to "
            f"{s['max_num_batched_tokens']:,} tokens and {s['max_batch_size']:,} sequences a step (paged); "
            f"the first {s['warmup']:,} requests of each seed left out.",
        ]
    for c in chats:
        s, f, later, r = c["settings"], c["first_ttft_ms"], c["later_ttft_ms"], c["ratio"]
        n = s["requests"]
        out += [
            "",
            f"Prefix caching: {n} chat requests sharing a {s['system_tokens']:,}-token system prompt "
            f"({c['prompt_tokens']:,} prompt tokens each), one after another, on {s['repeats']} fresh "
            f"servers ({s['device']}, {s['dtype']}, block {s['block_size']}): requests 2-{n} report at least "
            f"{c['min_cached_later']:,} cached tokens; their median TTFT is {later['median']:.1f} ms against "
            f"{f['median']:.1f} ms for the first, a ratio of {r['median']:.3f} "
            f"({r['min']:.3f}-{r['max']:.3f}). "
            f"Outputs equal a server's without prefix caching: {'yes' if c['outputs_equal'] else 'NO'}.",
        ]
    return "\n".join(out).lstrip("\n") + "\n"
