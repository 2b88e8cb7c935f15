"""Two costs of the CPU runtime that a GPU does not have, measured at the bundled model's shape.

``moeserve bench policies`` and the issue #15 grid run the runtime on this CPU, where the "device"
slots are host memory and the experts compute on the compute thread's core. Two effects there
weigh on buffers below 100% and have no counterpart on a GPU:

* **A landed expert computes slower right after its copy.** The I/O thread's ``copy_`` leaves the
  slot's cache lines dirty in its own core's cache; the compute thread then reads them from
  there. Timed: one expert (two ``F.linear`` and SwiGLU on ``rows`` tokens) right after the I/O
  thread copied it into its slot, right after the compute thread copied it itself, and again
  with the slot hot. A GPU's copy engine writes device memory; the kernel reads it from there
  either way.
* **A grouped call pays for every slot it spans.** ``F.grouped_mm`` on the CPU loops over every
  group, empty ones too, so a batch whose experts sit in scattered slots (the ``eam-reuse``
  cache's hits, whose victims are chosen by next use, not by place) costs more than the same
  experts in adjacent slots (what a round of demand copies often gets from LRU). Timed: the
  layer's grouped path (``LayerPlan.calls`` and ``_grouped``, :data:`MAX_GAP` as the runtime
  uses it) for ``used`` experts in adjacent slots and spread evenly over ``span`` slots. On CUDA
  :data:`MAX_GAP` spans any gap in one call; an empty group costs the kernel next to nothing.

Thread CPU time (``time.thread_time``), after ``--warmup`` untimed rounds; median and spread of
``--repeats`` repeats of ``--calls`` calls each. ``--json`` prints the settings and figures;
``--doc`` writes the table into ``docs/bench-experts.md`` (block ``cpu-costs``)::

    python tools/cpu_expert_costs.py --doc
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from moe_runtime.buffer.cache_policy import make_cache_policy  # noqa: E402
from moe_runtime.buffer.layer_run import handle  # noqa: E402
from moe_runtime.buffer.partition import Partition  # noqa: E402
from moe_runtime.layers.experts import MAX_GAP, LayerPlan, _expert_on_rows, _grouped  # noqa: E402
from moe_runtime.stats import ExpertStats  # noqa: E402

DOC = ROOT / "docs" / "bench-experts.md"


def _partition(slots: torch.Tensor, hidden: int, inter: int) -> Partition:
    """The runtime's partition over ``slots [S, 3 * I * H]`` (its slot views, as the experts read
    them; one MoE layer of ``S`` experts)."""
    n = slots.shape[0]
    policy = make_cache_policy("lru", n, n)
    return Partition(
        0, n, n, slots[0].nbytes, policy, ExpertStats(1), torch.device("cpu"), slots, hidden, inter
    )


def _stats(samples: list[float]) -> dict:
    us = [s * 1e6 for s in samples]
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us)}


def copy_costs(hidden: int, inter: int, rows: int, calls: int, repeats: int, warmup: int) -> dict:
    """One expert's compute (µs of thread CPU time) right after the I/O thread copied it into its
    slot, right after this thread did, and hot; the median per call of each repeat."""
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(3 * inter * hidden, generator=gen) for _ in range(64)]
    part = _partition(torch.empty(1, 3 * inter * hidden), hidden, inter)
    slot, h, cpu = part.slots[0], handle(0, part, 0, False, 0.0), torch.device("cpu")
    x = torch.randn(rows, hidden, generator=gen)

    def expert() -> torch.Tensor:  # a one-expert batch's two projections (the runtime's own)
        return _expert_on_rows(x, h, None, cpu)

    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def io() -> None:
        while (i := todo.get()) is not None:
            slot.copy_(sources[i])
            done.put(i)

    thread = threading.Thread(target=io, daemon=True)
    thread.start()
    kinds = ("after_io_thread_copy", "after_own_copy", "hot")
    per_repeat: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for rep in range(warmup + repeats):
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for c in range(calls):
                i = (rep * calls + c) % len(sources)
                todo.put(i)
                done.get()
                t0 = time.thread_time()
                expert()
                times["after_io_thread_copy"].append(time.thread_time() - t0)
                slot.copy_(sources[(i + 1) % len(sources)])
                t0 = time.thread_time()
                expert()
                times["after_own_copy"].append(time.thread_time() - t0)
                t0 = time.thread_time()
                expert()
                times["hot"].append(time.thread_time() - t0)
            if rep >= warmup:
                for k in kinds:
                    per_repeat[k].append(statistics.median(times[k]))
    finally:
        todo.put(None)
        thread.join()
    return {k: _stats(v) for k, v in per_repeat.items()}


def span_costs(
    hidden: int, inter: int, slots: int, used: int, rows: int, calls: int, repeats: int, warmup: int
) -> dict:
    """The grouped path for ``used`` experts of ``rows`` tokens each, in adjacent slots and spread
    evenly over all ``slots``: µs per layer batch (index work and both projections)."""
    gen = torch.Generator().manual_seed(0)
    part = _partition(torch.randn(slots, 3 * inter * hidden, generator=gen), hidden, inter)
    tokens = used * rows // 4  # top-4 routing, each expert chosen by ``rows`` tokens
    ids = (np.arange(tokens * 4).reshape(tokens, 4) % used).astype(np.int64)
    x = torch.randn(tokens, hidden, generator=gen)
    layouts = {
        "adjacent": list(range(used)),
        "spread": np.linspace(0, slots - 1, used).round().astype(int).tolist(),
    }
    out = {}
    for name, where in layouts.items():
        batch = [handle(e, part, s, True, 0.0) for e, s in enumerate(where)]

        def layer(batch: list = batch) -> None:
            plan = LayerPlan(ids, used, MAX_GAP["cpu"])
            for _, pos, segments, offs in plan.calls(batch):
                xs = x.index_select(0, torch.from_numpy(pos // 4))
                _grouped(xs, part, segments, torch.from_numpy(offs))

        per_repeat = []
        for rep in range(warmup + repeats):
            times = []
            for _ in range(calls):
                t0 = time.thread_time()
                layer()
                times.append(time.thread_time() - t0)
            if rep >= warmup:
                per_repeat.append(statistics.median(times))
        plan = LayerPlan(ids, used, MAX_GAP["cpu"])
        calls_made = sum(len(seg) for _, _, seg, _ in plan.calls(batch))
        out[name] = {**_stats(per_repeat), "grouped_calls": calls_made, "span": where[-1] - where[0] + 1}
    return out


def render(result: dict) -> str:
    s = result["settings"]
    c, g = result["copy"], result["span"]
    f = lambda d: f"{d['median_us']:.1f} [{d['min_us']:.1f}-{d['max_us']:.1f}]"  # noqa: E731
    lines = [
        f"settings: H={s['hidden']}, I={s['inter']} (the bundled model's expert, fp32), rows={s['rows']}, "
        f"slots={s['slots']}, used={s['used']}, torch {s['torch']}, {s['host']}, 1 CPU thread, "
        f"{s['warmup']} warm-up + {s['repeats']} repeats x {s['calls']} calls, thread CPU time, "
        f"median [min-max] of the repeats' medians",
        "",
        "| one expert, two `F.linear` + SwiGLU | µs |",
        "|---|---|",
        f"| right after the I/O thread copied it into its slot | {f(c['after_io_thread_copy'])} |",
        f"| right after the compute thread copied it itself | {f(c['after_own_copy'])} |",
        f"| hot (computed just before) | {f(c['hot'])} |",
        "",
        f"| {s['used']} experts in one grouped batch (`LayerPlan.calls` + `_grouped`) | slots spanned "
        "| grouped calls | µs |",
        "|---|---|---|---|",
    ]
    for name, label in (("adjacent", "adjacent slots"), ("spread", f"spread over {s['slots']} slots")):
        d = g[name]
        lines.append(f"| {label} | {d['span']} | {d['grouped_calls']} | {f(d)} |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    block = f"<!-- BEGIN cpu-costs -->\n```\n$ python tools/cpu_expert_costs.py\n```\n\n{text}\n<!-- END cpu-costs -->"
    pattern = re.compile(r"<!-- BEGIN cpu-costs -->.*?<!-- END cpu-costs -->", re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: block, doc)
    else:
        doc = doc.rstrip("\n") + "\n\n" + SECTION + block + "\n"
    DOC.write_text(doc)


SECTION = """## Costs of the CPU runtime a GPU does not have (`tools/cpu_expert_costs.py`)

Read with `bench policies` and the issue #15 grid, which run the runtime on this CPU. A landed
expert's first use reads the slot the I/O thread just wrote from that thread's core's cache; a
grouped batch on the CPU pays for every slot its calls span, so the `eam-reuse` cache's hits,
scattered over the partition, cost more to compute than the same experts in adjacent slots. A
GPU has neither cost (its copy engine writes device memory; on CUDA one grouped call spans any
gap and an empty group is next to free), so on the CPU these weigh against a cache that keeps
scattered experts and against every copied expert, prefetched or demanded. The first cost depends
on where the OS places the two threads and changes from run to run (rerun the command to see
it); the second does not.

"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4, help="tokens per expert (default 4)")
    ap.add_argument("--slots", type=int, default=128, help="partition slots (default 128: 25%% of 512)")
    ap.add_argument("--used", type=int, default=15, help="experts in the batch (default 15)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--doc", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    a = ap.parse_args(argv)
    if a.repeats < 3 or min(a.rows, a.slots, a.used, a.calls) < 1 or a.used > a.slots or a.warmup < 0:
        ap.error("--repeats >= 3, --rows/--slots/--used/--calls >= 1, --used <= --slots, --warmup >= 0")
    torch.set_num_threads(1)
    hidden, inter = 128, 64
    result = {
        "settings": {
            "hidden": hidden,
            "inter": inter,
            "rows": a.rows,
            "slots": a.slots,
            "used": a.used,
            "calls": a.calls,
            "repeats": a.repeats,
            "warmup": a.warmup,
            "torch": torch.__version__,
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        },
        "copy": copy_costs(hidden, inter, a.rows, a.calls, a.repeats, a.warmup),
        "span": span_costs(hidden, inter, a.slots, a.used, a.rows, a.calls, a.repeats, a.warmup),
    }
    text = render(result)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(text)
    if a.doc:
        write_doc(text)


if __name__ == "__main__":
    main()
