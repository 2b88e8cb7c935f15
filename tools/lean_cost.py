"""Host cost per MoE layer of on-demand + LRU against the ``eam`` policy held in each of its modes.

Runs the bundled model on the runtime (CPU) with an emulated link and decodes a few batches of
random prompts: ``on-demand`` + ``lru``, then ``eam`` + ``eam-reuse`` with its measured trial
pinned to each mode (``moe_runtime.prefetch.trial.MODES``): ``lean`` (no planning, no router
lookahead, the cache evicting LRU), ``cache`` (caching alone, the default trial's reference) and
``prefetch`` (for scale).
Per decode MoE layer it reports the compute thread's CPU time (``time.thread_time_ns``) of the
whole MoE block and of its hooks (the tracer's ``record``, ``buffer.after_routing``, the prefetch
policy's ``after_routing``), the per-step hooks (``recorder.end_step``, ``prefetcher.end_step``)
spread over the step's layers, the I/O thread's victim choice (thread CPU time, under the buffer
lock) and the aten ops of the MoE block. Thread CPU time is not inflated by other processes
preempting the thread, but a shared host still moves it (caches, frequency): repeat and compare.

    PYTHONPATH=$PWD python tools/lean_cost.py --fraction 0.5 --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_runtime.model as model_mod
from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _wrap(obj, name: str, acc: dict, key: str, clock=time.thread_time_ns) -> None:
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += clock() - t0

    setattr(obj, name, timed)


def measure(prefetch: str, cache: str, args, count_ops: bool, mode: str = "lean") -> dict[str, float]:
    runtime = RuntimeConfig(
        buffer_fraction=args.fraction,
        max_batch_size=args.batch,
        max_model_len=160,
        link_gbps=args.link_gbps or None,
        prefetch_policy=prefetch,
        cache_policy=cache,
    )
    rng = np.random.default_rng(args.seed)
    acc: dict[str, float] = defaultdict(float)
    layers = [0]
    ops = [0]
    with LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        pf = engine.prefetcher
        trial = getattr(pf, "trial", None)
        if trial is not None:  # the trial's mode, pinned
            pf.pin(mode)
        rec = engine.recorder
        if rec is not None:
            _wrap(rec, "record", acc, "record")
            _wrap(rec, "end_step", acc, "recorder.end_step")
        _wrap(engine.buffer, "after_routing", acc, "buffer.after_routing")
        _wrap(pf, "after_routing", acc, "prefetch.after_routing")
        _wrap(pf, "end_step", acc, "prefetch.end_step")
        for part in engine.buffer.parts:
            _wrap(part, "_victim", acc, "victim (I/O thread)")
        block = model_mod.moe_block
        batch = args.batch

        def counted(x, *a, **k):
            if x.shape[0] != batch:
                return block(x, *a, **k)
            layers[0] += 1
            t0 = time.thread_time_ns()
            if count_ops:
                with _Ops() as c:
                    out = block(x, *a, **k)
                ops[0] += c.ops
            else:
                out = block(x, *a, **k)
            acc["moe_block"] += time.thread_time_ns() - t0
            return out

        model_mod.moe_block = counted
        try:
            params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            for _ in range(args.batches):
                prompts = [rng.integers(3, 1000, size=24).tolist() for _ in range(batch)]
                engine.generate(prompts, params)
        finally:
            model_mod.moe_block = block
    n = max(1, layers[0])
    out = {k: v / n / 1e3 for k, v in acc.items()}
    if count_ops:
        out["aten ops"] = ops[0] / n
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--link-gbps", type=float, default=0.5, help="0 = no emulated link")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = {
        "on-demand+lru": ("on-demand", "lru", "lean"),  # no trial: the mode is unused
        "eam lean": ("eam", "eam-reuse", "lean"),
        "eam cache": ("eam", "eam-reuse", "cache"),
        "eam prefetching": ("eam", "eam-reuse", "prefetch"),
    }
    res: dict[str, list[dict[str, float]]] = {k: [] for k in rows}
    for _ in range(args.repeats):
        for label, (pf, cache, mode) in rows.items():
            res[label].append(measure(pf, cache, args, False, mode))
    ops = {
        label: measure(pf, cache, args, True, mode)["aten ops"] for label, (pf, cache, mode) in rows.items()
    }
    keys = sorted({k for runs in res.values() for run in runs for k in run})
    print(f"us of thread CPU time per decode MoE layer (median of {args.repeats} runs)")
    print(f"{'':<26}" + "".join(f"{label:>16}" for label in rows))
    for k in keys:
        vals = [statistics.median(run.get(k, 0.0) for run in res[label]) for label in rows]
        print(f"{k:<26}" + "".join(f"{v:>16.1f}" for v in vals))
    print(f"{'aten ops per MoE block':<26}" + "".join(f"{ops[label]:>16.1f}" for label in rows))


if __name__ == "__main__":
    main()
