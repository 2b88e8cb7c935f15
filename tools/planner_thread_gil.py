"""Would a planner thread take a plan's host time off the compute thread? A GIL measurement.

Issue #15 asks whether prefetch planning can move to a second Python thread. This script runs a
stand-in for a decode layer on the compute thread (a few small ``F.linear`` calls, single-threaded
torch) and a stand-in for one plan (dozens of small numpy calls, as a planning layer makes) either
inline after each layer or on a planner thread woken after each layer (a newer wake-up supersedes a
pending one). It prints, per layer, the compute thread's wall time and its CPU time
(``time.thread_time``): the CPU time shows the work that moved, the wall time whether the compute
thread got faster, which it does not where the planner holds the GIL while the compute thread
needs it to dispatch its next op.

    python tools/planner_thread_gil.py --layers 2000 --width 1024
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch


def plan_work(rng: np.random.Generator) -> None:
    """About 240 small numpy calls on a [1, 128] row (~220 us here): a planning layer's kind of work."""
    a = rng.random((1, 128)).astype(np.float32)
    for _ in range(60):
        a = np.where(a > 0.5, a, 0.0)
        a = a / (a.sum(axis=1, keepdims=True) + 1)


def run(threaded: bool, layers: int, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float, int]:
    """``(wall us, thread CPU us)`` per layer of the compute thread, and the plans made."""
    rng = np.random.default_rng(0)
    wake, done, plans = threading.Event(), threading.Event(), [0]

    def planner() -> None:
        while not done.is_set():
            if wake.wait(0.01):
                wake.clear()
                plan_work(rng)
                plans[0] += 1

    thread = threading.Thread(target=planner, daemon=True) if threaded else None
    if thread is not None:
        thread.start()
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(layers):
        y = x
        for _ in range(6):
            y = torch.nn.functional.linear(y, w) * 0.01
        if thread is not None:
            wake.set()
        else:
            plan_work(rng)
            plans[0] += 1
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    done.set()
    if thread is not None:
        thread.join()
    return wall / layers * 1e6, cpu / layers * 1e6, plans[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2000, help="layers per run (default 2000)")
    ap.add_argument("--width", type=int, default=1024, help="hidden size of the stand-in layer")
    ap.add_argument("--rounds", type=int, default=2, help="inline/threaded pairs (default 2)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(1, args.width), torch.randn(args.width, args.width)
    for _ in range(args.rounds):
        for threaded in (False, True):
            wall, cpu, plans = run(threaded, args.layers, x, w)
            label = "planner thread" if threaded else "inline plan   "
            print(f"{label}: compute thread wall {wall:.0f} us/layer, CPU {cpu:.0f} us/layer, plans {plans}")


if __name__ == "__main__":
    main()
