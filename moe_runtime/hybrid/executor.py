"""The CPU expert executor: experts computed on host threads straight from the host store.

As Fiddler and llama.cpp's ``--n-cpu-moe`` do, a missed expert can run where its weights already
are: host memory, which a CPU reads faster than a PCIe link moves it. :class:`CPUExpertExecutor`
is a pool of host threads; each job is one expert over its token rows (the projections of the
kernel :func:`~moe_runtime.hybrid.cpu_kernels.choose_kernels` picked for that many rows, the
device path's own activation and biases between them). torch ops release the GIL, so jobs run in
parallel; each pool thread keeps one OpenMP thread (``omp_set_num_threads(1)`` for itself) so the
pool does not multiply the compute thread's intra-op threads.

:class:`CPUExperts` is one layer run's share: ``start`` sends only the hidden rows of the CPU
experts' tokens to the host (on CUDA: one gather and one non-blocking copy into pinned memory on
the compute stream, an event the jobs wait on in their own threads) and submits the jobs, before
the device computes the resident experts; ``finish`` brings each output ``[T_e, H]`` back (on CUDA
from pinned memory, non-blocking), scaled by its router weights and cast as the device path does,
and says at which ``(token, rank)`` positions it goes. No host sync is added on the device stream.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from moe_runtime.hybrid.cpu_kernels import KernelChoice, run_projections
from moe_runtime.layers.experts import ExpertFFN, _biased, _hidden


def _one_omp_thread() -> None:
    """Pool thread initializer: this thread's OpenMP team is one thread (the ICV is per thread,
    so the compute thread keeps its ``--cpu-threads``)."""
    with contextlib.suppress(OSError, AttributeError):  # no OpenMP runtime in the process: nothing to set
        ctypes.CDLL(None).omp_set_num_threads(1)


class CPUExpertExecutor:
    """Host threads computing experts from the host store.

    Args:
        store: the :class:`~moe_runtime.store.HostExpertStore`.
        choice: the kernels by row count (:func:`~moe_runtime.hybrid.cpu_kernels.choose_kernels`).
        threads: pool threads (>= 1).

    Attributes:
        samples: ``(rows, seconds)`` of each finished job, appended by the pool threads and
            drained by the placement (its CPU cost fit), a thread-safe deque.
    """

    def __init__(self, store: Any, choice: KernelChoice, threads: int) -> None:
        self.store, self.choice, self.threads = store, choice, max(1, threads)
        self.pool = ThreadPoolExecutor(self.threads, "moeserve-cpu-expert", initializer=_one_omp_thread)
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)
        self._host_bias: dict[int, torch.Tensor] = {}
        self._bias_lock = threading.Lock()

    def host_bias(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` (a resident per-expert bias table) on the host, copied once."""
        if t is None or t.is_cpu:
            return t
        with self._bias_lock:
            got = self._host_bias.get(id(t))
            if got is None:
                got = self._host_bias[id(t)] = t.to("cpu")
        return got

    def run(
        self, key: int, xs: torch.Tensor, ffn: ExpertFFN | None, expert: int
    ) -> tuple[torch.Tensor, float]:
        """Expert ``key``'s output ``[n, H]`` for ``xs [n, H]`` (host, compute dtype), and the
        seconds it took on this thread. Called on a pool thread."""
        t0 = time.perf_counter()
        kernel = self.choice.for_rows(xs.shape[0])
        gu_bias = down_bias = None
        if ffn is not None:
            gu_bias, down_bias = (
                None if b is None else self.host_bias(b)[expert] for b in (ffn.gate_up_bias, ffn.down_bias)
            )
        with torch.inference_mode():
            y = run_projections(kernel, key, xs, lambda gu: _hidden(gu, ffn, gu_bias))
            y = _biased(y, down_bias)
        seconds = time.perf_counter() - t0
        self.samples.append((xs.shape[0], seconds))
        return y, seconds

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (int64) on ``device``: itself on the CPU; elsewhere through pinned memory, so the
    non-blocking copy neither waits for the stream nor blocks the host."""
    t = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64))
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def expert_rows(ids_host: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``expert -> (tokens [n], columns [n], positions [n])`` of ``ids_host [T, k]``: the tokens
    that chose it, the column of that choice in the router weights and the ``(token, rank)``
    position ``token * k + rank`` with ranks sorted by expert id (the order of the per-token sum)."""
    t, k = ids_host.shape
    order = np.argsort(ids_host, axis=1, kind="stable")  # [T, k] columns by expert id
    sorted_ids = np.take_along_axis(ids_host, order, axis=1).reshape(-1)
    tok = np.repeat(np.arange(t), k)
    pos = np.arange(t * k)
    by_expert = np.argsort(sorted_ids, kind="stable")
    e_sorted = sorted_ids[by_expert]
    bounds = np.flatnonzero(np.diff(e_sorted)) + 1
    out = {}
    for chunk in np.split(by_expert, bounds):
        e = int(sorted_ids[chunk[0]])
        out[e] = (tok[chunk], order.reshape(-1)[chunk], pos[chunk])
    return out


class CPUExperts:
    """The experts one layer run computes on the CPU (:meth:`start`, then :meth:`finish`).

    Args:
        executor: the pool. layer: MoE layer. experts: the CPU-placed experts (ascending).
        num_experts: E (flat key ``layer * E + expert``).
        stats: the buffer's :class:`~moe_runtime.stats.ExpertStats` (CPU seconds and waits).
    """

    def __init__(
        self, executor: CPUExpertExecutor, layer: int, experts: list[int], num_experts: int, stats
    ) -> None:
        self.executor, self.layer, self.experts = executor, layer, sorted(experts)
        self.key0 = layer * num_experts
        self.stats = stats
        self.jobs: list[tuple[int, np.ndarray, np.ndarray, Future]] = []
        self.seconds: dict[int, float] = {}

    def start(self, x: torch.Tensor, ids_host: np.ndarray, ffn: ExpertFFN | None) -> None:
        """Stage the CPU experts' token rows of ``x [T, H]`` on the host and submit their jobs."""
        rows = expert_rows(ids_host)
        mine = [(e, *rows[e]) for e in self.experts]
        ready = None
        if x.is_cpu:
            host, local = x, {e: tok for e, tok, _, _ in mine}
        else:  # only the tokens' rows cross, one gather and one non-blocking copy
            tokens = np.unique(np.concatenate([tok for _, tok, _, _ in mine]))
            idx = upload(tokens, x.device)
            host = x.index_select(0, idx).to("cpu", non_blocking=True)  # pinned, on the compute stream
            ready = torch.cuda.Event()
            ready.record()
            local = {e: np.searchsorted(tokens, tok) for e, tok, _, _ in mine}
        submit, run = self.executor.pool.submit, self._job
        for e, tok, col, pos in mine:
            self.jobs.append(
                (e, tok * ids_host.shape[1] + col, pos, submit(run, e, host, local[e], ready, ffn))
            )

    def _job(self, e: int, host: torch.Tensor, rows: np.ndarray, ready: Any, ffn: ExpertFFN | None):
        if ready is not None:
            ready.synchronize()  # this thread waits for the rows' copy, not the compute thread
        r = int(rows[0])
        xs = host[r : r + 1] if len(rows) == 1 else host.index_select(0, torch.from_numpy(rows))
        y, seconds = self.executor.run(self.key0 + e, xs, ffn, e)
        if ready is not None:  # a CUDA run: the output goes back from pinned memory
            pinned = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
            pinned.copy_(y)
            y = pinned
        return y, seconds

    def finish(
        self, x: torch.Tensor, weights: torch.Tensor
    ) -> list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """Wait for every job; per CPU expert ``(positions [n], positions on x's device, y [n, H])``:
        its output scaled by its router weights (``weights [T, k]``) and cast to ``x``'s dtype, as
        the device paths do, on ``x``'s device, and the ``(token, rank)`` positions it fills."""
        out = []
        w_flat = weights.reshape(-1)
        waited = 0.0
        for e, src, pos, fut in self.jobs:
            t0 = time.perf_counter()
            y, seconds = fut.result()
            waited += time.perf_counter() - t0
            self.seconds[e] = seconds
            if y.device != x.device:
                y = y.to(x.device, non_blocking=True)
            idx = upload(np.concatenate([src, pos]), x.device)  # one upload: weight and row index
            y = y * w_flat.index_select(0, idx[: len(src)]).unsqueeze(1)
            out.append((pos, idx[len(src) :], y if y.dtype == x.dtype else y.to(x.dtype)))
        st = self.stats
        st.cpu_wait_s += waited
        st.cpu_expert_s += sum(self.seconds.values())
        self.jobs = []
        return out

    def mask(self, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """``(on_cpu [E] bool, seconds [E])`` of the layer, for the per-request figures."""
        on_cpu = np.zeros(num_experts, dtype=bool)
        secs = np.zeros(num_experts)
        on_cpu[self.experts] = True
        for e, s in self.seconds.items():
            secs[e] = s
        return on_cpu, secs
