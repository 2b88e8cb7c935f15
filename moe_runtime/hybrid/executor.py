"""The CPU expert executor: experts computed by a pool of host threads straight from the host store.

As Fiddler and llama.cpp's ``--n-cpu-moe`` do, a missed expert can run where its weights already
are: host memory, which a CPU reads faster than a PCIe link moves it. At decode a layer has one
or two such experts, each a matrix-vector product whose time is reading its weights, and one
thread reads host memory at about one core's rate. So :class:`CPUExpertExecutor` splits every
CPU expert over all its pool threads by ranges of output rows, as llama.cpp and KTransformers
split a matrix product's rows over their threads: the pool is one lane that works on the layer's
experts together and reads at the socket's rate.

A run (:class:`Batch`) is a list of units: every unsplit expert whole (one unit, start to end on
one thread), every split expert's gate/up ranges, then their down ranges, expert by expert. The
down projection needs the whole activated ``[n, I]`` of its expert, so each expert has a barrier
of its own: the worker that completes its last gate/up unit joins the ranges (bit for bit the
whole product: :data:`~moe_runtime.hybrid.cpu_kernels.ROW_ALIGN`,
:meth:`CPUExpertExecutor.check_split`), applies the device path's activation and biases, and
releases the expert's down units; a worker that takes a down unit of an expert not yet released
waits for it, which a running worker is completing (no deadlock however many workers run). The
worker that completes an expert's last down unit joins its output. Workers take units from one
shared iterator, so a fast worker takes more (KTransformers' dynamic split of a layer's work). The
caller submits one worker, which submits the others: the compute thread pays one submit a layer.
When the compute thread reaches the layer's CPU outputs it takes the units no worker has taken
yet, as an OpenMP master thread joins its team (:meth:`Batch.wait`): it neither idles while CPU
work is left nor waits for a sleeping worker's wake-up (50-100 us on the 2-core host) when the
device's share ended first. It does so only with one OpenMP thread of its own, so a unit gives
the same bits whichever thread runs it, and only for experts of at least :data:`MIN_UNIT_BYTES`.

Each pool thread keeps one OpenMP thread (``omp_set_num_threads(1)`` for itself), so the pool
does not multiply the compute thread's intra-op threads. A range is at least
:data:`MIN_UNIT_BYTES` of weights: each unit costs some Python on the GIL, which small experts
(the bundled model's) cannot amortise over many threads.

One layer run's share of the pool (its tokens' rows in, its outputs back) is
:class:`~moe_runtime.hybrid.layer_share.CPUExperts`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from moe_runtime.hybrid.cpu_kernels import ROW_ALIGN, Kernel, run_projections
from moe_runtime.hybrid.kernel_choice import KernelChoice
from moe_runtime.layers.experts import _biased, _hidden

#: least weight bytes in one range of a split projection. A unit costs about 10 us of Python on
#: the GIL (its weight view, the op's dispatch, the barrier's bookkeeping; bench cpu-experts on the
#: 2-core EPYC host), which one core reading 1 MiB at 10-20 GB/s takes 50-100 us to amortise
MIN_UNIT_BYTES = 1 << 20
#: token rows at which :meth:`CPUExpertExecutor.check_split` compares ranges with whole products
CHECK_ROWS = (1, 3, 5, 32)


def split_ranges(n_out: int, row_bytes: int, threads: int, min_unit_bytes: int) -> list[tuple[int, int]]:
    """Ranges ``[(first, end), ...]`` of a projection's ``n_out`` output rows (``row_bytes`` of
    weights each) over ``threads`` threads: about one per thread, each starting at a multiple of
    ``ROW_ALIGN`` rows and holding at least ``min_unit_bytes`` of weights (one range: whole)."""
    if threads <= 1:
        return [(0, n_out)]
    step = max(-(-n_out // threads), -(-min_unit_bytes // max(1, row_bytes)))
    step = -(-step // ROW_ALIGN) * ROW_ALIGN
    return [(r, min(r + step, n_out)) for r in range(0, n_out, step)]


def pool_thread_init(device: torch.device | None = None) -> None:
    """Pool thread initializer: this thread's OpenMP team is one thread (the ICV is per thread,
    so the compute thread keeps its ``--cpu-threads``). ATen's per-thread set-up runs first: its
    first parallel op would otherwise set the team back to the process's ``--cpu-threads``. On
    CUDA the engine's device becomes this thread's current one, so its pinned buffers and event
    waits use that device's context (a new thread's current device is 0)."""
    torch.get_num_threads()  # ATen's lazy per-thread init, now rather than at the first op
    with contextlib.suppress(OSError, AttributeError):  # no OpenMP runtime in the process: nothing to set
        ctypes.CDLL(None).omp_set_num_threads(1)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


class CPUExpertExecutor:
    """A pool of host threads computing experts from the host store, every thread on each expert.

    Args:
        store: the :class:`~moe_runtime.store.HostExpertStore`.
        choice: the kernels by row count (:func:`~moe_runtime.hybrid.kernel_choice.choose_kernels`);
            None: set later with :meth:`set_choice` (the runtime measures the kernels on this pool).
        threads: pool threads (>= 1).
        min_unit_bytes: least weight bytes of one range (None: :data:`MIN_UNIT_BYTES`).
        helps: the thread that waits for a batch takes its untaken units (:meth:`Batch.wait`);
            only where that thread runs one OpenMP thread, as the pool's do (the same bits), and
            for experts of at least ``min_unit_bytes``.
        device: the engine's device; a CUDA one becomes the pool threads' current device.

    Attributes:
        samples: ``(rows, seconds)`` of each CPU expert of each finished layer run (its share of
            the batch's time), appended by :meth:`CPUExperts.finish` and drained by the placement
            (its CPU cost fit), a thread-safe deque.
        start_samples: per finished layer run, seconds from its submit to its first unit's start
            (:attr:`Batch.start_s`), drained by the placement likewise.
        whole: names of kernels whose ranges did not give the whole product's bits: run whole.
    """

    def __init__(
        self,
        store: Any,
        choice: KernelChoice | None,
        threads: int,
        min_unit_bytes: int | None = None,
        helps: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.store, self.threads = store, max(1, threads)
        self.min_unit_bytes = MIN_UNIT_BYTES if min_unit_bytes is None else min_unit_bytes
        # only experts of at least a unit's bytes: a small one's Python would contend for the GIL
        # with the pool's (the bundled model's 96 KiB experts at batch 4: cpu mode 1.2-1.3x slower)
        self.helps = helps and store.expert_nbytes >= self.min_unit_bytes
        self.pool = ThreadPoolExecutor(
            self.threads, "moeserve-cpu-expert", initializer=pool_thread_init, initargs=(device,)
        )
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)
        self.start_samples: collections.deque[float] = collections.deque(maxlen=4096)
        self.whole: set[str] = set()
        self._checked: set[str] = set()  # kernels whose ranges were compared already (check_split)
        self._plans: dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
        self._host_bias: dict[int, torch.Tensor] = {}
        self._bias_lock = threading.Lock()
        self.choice: KernelChoice | None = None
        if choice is not None:
            self.set_choice(choice)

    def set_choice(self, choice: KernelChoice) -> None:
        """Use ``choice``'s kernels (their ranges checked first: :meth:`check_split`)."""
        self.check_split(choice.kernels)
        self.choice = choice

    # ------------------------------------------------------------------ ranges
    def _plan(self, kernel: Kernel, n_out: int, row_bytes: int) -> list[tuple[int, int]]:
        if not kernel.splits or kernel.name in self.whole:
            return [(0, n_out)]
        return split_ranges(n_out, row_bytes, self.threads, self.min_unit_bytes)

    def plans(self, kernel: Kernel) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(gate/up ranges, down ranges)`` of ``kernel``'s experts (:func:`split_ranges`); one
        whole range where the kernel does not split."""
        got = self._plans.get(kernel.name)
        if got is None:
            st = self.store
            h, i, nbytes = st.hidden_size, st.intermediate_size, st.expert_nbytes
            got = self._plans[kernel.name] = (
                self._plan(kernel, 2 * i, nbytes // (3 * i)),
                self._plan(kernel, h, nbytes // (3 * h)),
            )
        return got

    def check_split(self, kernels: list[Kernel], rows: tuple[int, ...] = CHECK_ROWS) -> None:
        """Per kernel that splits here: its ranges joined against its whole products on the store's
        first expert, at ``rows`` token rows, on a pool thread (one OpenMP thread, as it runs); a
        kernel whose bits differ joins :attr:`whole`."""
        st = self.store
        h, i, dtype = st.hidden_size, st.intermediate_size, st.compute_dtype

        def same(k: Kernel) -> bool:
            gu_plan, down_plan = self.plans(k)
            gen = torch.Generator().manual_seed(0)
            with torch.inference_mode():
                for n in rows:
                    x = torch.randn(n, h, generator=gen).to(dtype)
                    y = torch.randn(n, i, generator=gen).to(dtype)
                    gu = torch.cat([k.gate_up_rows(0, x, a, b) for a, b in gu_plan], dim=1)
                    down = torch.cat([k.down_rows(0, y, a, b) for a, b in down_plan], dim=1)
                    if not (torch.equal(gu, k.gate_up(0, x)) and torch.equal(down, k.down(0, y))):
                        return False
            return True

        for k in {k.name: k for k in kernels}.values():
            if k.name in self.whole or k.name in self._checked or sum(map(len, self.plans(k))) == 2:
                continue
            self._checked.add(k.name)
            if not self.pool.submit(same, k).result():
                self.whole.add(k.name)
                self._plans.pop(k.name, None)

    # ------------------------------------------------------------------ runs
    def host_bias(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` (a resident per-expert bias table) on the host, copied once."""
        if t is None or t.is_cpu:
            return t
        with self._bias_lock:
            got = self._host_bias.get(id(t))
            if got is None:
                got = self._host_bias[id(t)] = t.to("cpu")
        return got

    def expert(
        self, key: int, rows: np.ndarray, hidden: Any, down_bias: torch.Tensor | None, plain: bool = False
    ) -> _Expert:
        """One expert of a :class:`Batch`: flat ``key``, its token ``rows`` of the batch's host
        tensor, ``hidden`` (``[n, 2I] -> [n, I]``: the device path's activation and gate/up bias),
        its down bias; ``plain``: ``hidden`` is the plain SwiGLU with no biases (a fused kernel may
        run the whole expert in one call); the kernel the choice names for its row count."""
        kernel = self.choice.for_rows(len(rows))
        return _Expert(key, kernel, self.plans(kernel), rows, hidden, down_bias, plain)

    def submit(self, experts: list[_Expert], host: torch.Tensor, ready: Any = None) -> Batch:
        """Start ``experts`` over ``host`` (their token rows; ``ready``: a CUDA event the workers
        wait on before reading it, None on the CPU) on the pool."""
        return Batch(self, experts, host, ready)

    def run_one(self, kernel: Kernel, key: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``key`` over ``x [n, H]`` with ``kernel`` on the whole pool (SwiGLU, no biases):
        the load-time measurement of the kernels (``choose_kernels(run=...)``). An unsplit expert
        runs on the calling thread where it :attr:`helps`, as the compute thread would take it:
        the pool's hand-off is the placement's measured start delay, not a kernel's cost."""
        e = _Expert(key, kernel, self.plans(kernel), np.arange(x.shape[0]), _swiglu, None, True)
        e.xs = x
        if self.helps and e.whole:  # one unit the waiting caller would take itself: no hand-off
            return Batch(self, [e], x, None, start=False).wait(True)[0][0]
        return self.submit([e], x).wait(self.helps)[0][0]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    return _hidden(gu, None, None)


class _Expert:
    """One expert's share of a :class:`Batch`: its ranges, their outputs and its two barriers."""

    __slots__ = ("key", "kernel", "gu_plan", "down_plan", "rows", "hidden", "down_bias", "xs", "gu",
                 "down", "gu_left", "down_left", "h", "released", "y", "plain", "whole")  # fmt: skip

    def __init__(self, key, kernel, plans, rows, hidden, down_bias, plain=False) -> None:
        self.key, self.kernel, self.rows, self.hidden, self.down_bias = key, kernel, rows, hidden, down_bias
        self.gu_plan, self.down_plan = plans
        self.plain = plain
        # unsplit: one unit, the whole expert on one thread (its down needs all of its gate/up)
        self.whole = len(self.gu_plan) == 1 and len(self.down_plan) == 1
        self.gu: list[Any] = [None] * len(self.gu_plan)
        self.down: list[Any] = [None] * len(self.down_plan)
        self.gu_left, self.down_left = len(self.gu_plan), len(self.down_plan)
        self.xs: torch.Tensor | None = None
        self.h: torch.Tensor | None = None
        self.released = threading.Event()  # its activation is in: its down units may run
        self.y: torch.Tensor | None = None


class Batch:
    """Experts computed together by the pool's workers (see the module note); :meth:`wait` gives
    each output and its share of the batch's seconds."""

    def __init__(
        self,
        executor: CPUExpertExecutor,
        experts: list[_Expert],
        host: torch.Tensor,
        ready: Any,
        start: bool = True,
    ) -> None:
        """``start``: hand the units to the pool now (False: only the caller's :meth:`wait` runs
        them, with ``help``)."""
        self.executor, self.experts, self.host, self.ready = executor, experts, host, ready
        self.pinned = ready is not None  # a CUDA run: outputs go back from pinned memory
        whole = [(2, i, 0) for i, e in enumerate(experts) if e.whole]
        gu = [(0, i, j) for i, e in enumerate(experts) if not e.whole for j in range(len(e.gu_plan))]
        down = [(1, i, j) for i, e in enumerate(experts) if not e.whole for j in range(len(e.down_plan))]
        gu = whole + gu
        self._units = iter(gu + down)  # one shared iterator: next() hands each unit out once
        self.lock = threading.Lock()
        self.left = len(gu) + len(down)  # units not yet completed
        self.done = threading.Event()  # every unit completed, or one failed
        self.first_start, self.last_end = math.inf, 0.0  # first unit's start, last one's end
        self.work = [0.0] * len(experts)  # thread-seconds per expert
        self.error: BaseException | None = None
        n = min(executor.threads, max(len(gu), len(down)))
        # one submit from the caller (the compute thread); the first worker starts the others
        self.t_submit = time.perf_counter()
        self.start_s = 0.0  # submit to the first unit's start, set by wait()
        if not self.left:
            self.done.set()
        if start:
            self.first: Future = executor.pool.submit(self._launch, n)
            self.first.add_done_callback(self._launched)

    def _launched(self, f: Future) -> None:
        """A failure to start the workers (the pool shut down) ends the batch instead of a hang."""
        exc = f.exception()
        if exc is not None:
            self.error = self.error or exc
            self.done.set()

    def _launch(self, n: int) -> None:
        submit = self.executor.pool.submit
        for _ in range(n - 1):
            submit(self._worker)  # their end is the units' count, not their futures
        self._worker()

    def _rows(self, e: _Expert) -> torch.Tensor:
        """The expert's token rows of the host tensor, gathered once (by the first worker)."""
        with self.lock:
            if e.xs is None:
                rows, host = e.rows, self.host
                r = int(rows[0])
                e.xs = host[r : r + 1] if len(rows) == 1 else host.index_select(0, torch.from_numpy(rows))
            return e.xs

    def _worker(self) -> None:
        """Take units until none is left (a pool thread, or the caller helping in :meth:`wait`)."""
        if self.ready is not None:
            self.ready.synchronize()  # this thread waits for the rows' copy, not the compute thread
        try:
            with torch.inference_mode():
                for phase, i, j in self._units:
                    u0 = time.perf_counter()
                    e = self.experts[i]
                    if phase == 0:
                        self._gate_up(e, j)
                    elif phase == 2:
                        self._whole(e)
                    elif not self._down(e, j):
                        return
                    u1 = time.perf_counter()
                    with self.lock:
                        self.work[i] += u1 - u0
                        self.first_start = min(self.first_start, u0)
                        self.last_end = max(self.last_end, u1)
                        self.left -= 1
                        if not self.left:
                            self.done.set()
        except BaseException as exc:
            self.error = exc
            for e in self.experts:  # wake the workers waiting on a barrier: they stop
                e.released.set()
            self.done.set()
            raise

    def _whole(self, e: _Expert) -> None:
        """An unsplit expert, start to end on this thread: a fused kernel's one call where the
        activation is the plain SwiGLU, else its two projections around the device path's."""
        xs = e.xs if e.xs is not None else self._rows(e)
        k = e.kernel
        if e.plain and k.fused:
            self._finish(e, k.swiglu(e.key, xs))
        else:
            self._finish(e, _biased(run_projections(k, e.key, xs, e.hidden), e.down_bias))

    def _gate_up(self, e: _Expert, j: int) -> None:
        xs = e.xs if e.xs is not None else self._rows(e)
        k = e.kernel
        if len(e.gu_plan) == 1:
            e.gu[0] = k.gate_up(e.key, xs)
        else:
            a, b = e.gu_plan[j]
            e.gu[j] = k.gate_up_rows(e.key, xs, a, b)
        with self.lock:
            e.gu_left -= 1
            last = not e.gu_left
        if last:  # the expert's barrier: the whole [n, 2I] is in
            gu = e.gu[0] if len(e.gu) == 1 else torch.cat(e.gu, dim=1)
            e.gu = []
            e.h = e.hidden(gu)
            e.released.set()

    def _down(self, e: _Expert, j: int) -> bool:
        if not e.released.is_set():
            e.released.wait()
        if self.error is not None:
            return False
        k = e.kernel
        if len(e.down_plan) == 1:
            e.down[0] = k.down(e.key, e.h)
        else:
            a, b = e.down_plan[j]
            e.down[j] = k.down_rows(e.key, e.h, a, b)
        with self.lock:
            e.down_left -= 1
            last = not e.down_left
        if last:
            y = e.down[0] if len(e.down) == 1 else torch.cat(e.down, dim=1)
            e.down, e.h = [], None
            self._finish(e, _biased(y, e.down_bias))
        return True

    def _finish(self, e: _Expert, y: torch.Tensor) -> None:
        """The expert's output ``[n, H]``: kept, in pinned memory for a CUDA run."""
        if self.pinned:
            pinned = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
            pinned.copy_(y)
            y = pinned
        e.y = y

    def wait(self, help: bool = True) -> list[tuple[torch.Tensor, float]]:
        """Wait for every unit; per expert ``(output [n, H], seconds)``: the batch's time from its
        first unit to its last, shared out by each expert's thread-seconds (so the experts'
        seconds add up to the batch's). ``help``: the caller first takes units no worker has
        taken yet, as an OpenMP master thread does (a unit gives the same bits on any thread
        with one OpenMP thread), so it neither idles nor waits for a worker's wake-up; the
        caller passes False where its own thread runs more OpenMP threads.

        Raises: what a unit raised, in any thread."""
        if help and not self.done.is_set():
            self._worker()
        self.done.wait()
        if self.error is not None:
            raise self.error
        first = self.first_start
        wall = self.last_end - first
        self.start_s = max(0.0, first - self.t_submit)
        total = sum(self.work)
        n = len(self.experts)
        return [(e.y, wall * (w / total if total > 0 else 1 / n)) for e, w in zip(self.experts, self.work)]
