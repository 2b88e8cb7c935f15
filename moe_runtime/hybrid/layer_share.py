"""One layer run's CPU experts on the pool (:class:`CPUExperts`): their tokens' rows to the host,
their batch on the :class:`~moe_runtime.hybrid.executor.CPUExpertExecutor`, their outputs back.

``start`` sends only the hidden rows of the CPU experts' tokens to the host (on CUDA: one gather
and one non-blocking copy into pinned memory on the compute stream, an event the workers wait on
in their own threads) and starts the batch, before the device computes the resident experts;
``finish`` brings each output ``[T_e, H]`` back (on CUDA from pinned memory, non-blocking), scaled
by its router weights and cast as the device path does, and says at which ``(token, rank)``
positions it goes. No host sync is added on the device stream.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moe_runtime.hybrid.executor import Batch, CPUExpertExecutor
from moe_runtime.layers.experts import ExpertFFN, _hidden


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
        self.places: list[tuple[int, np.ndarray, np.ndarray]] = []  # (expert, weight index, positions)
        self.batch: Batch | None = None
        self.seconds: dict[int, float] = {}

    def start(self, x: torch.Tensor, ids_host: np.ndarray, ffn: ExpertFFN | None) -> None:
        """Stage the CPU experts' token rows of ``x [T, H]`` on the host and start their batch."""
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
            ready.record(torch.cuda.current_stream(x.device))  # x's device, whichever is current
            local = {e: np.searchsorted(tokens, tok) for e, tok, _, _ in mine}
        ex, k = self.executor, ids_host.shape[1]
        gu_table = down_table = None
        if ffn is not None:
            gu_table, down_table = ex.host_bias(ffn.gate_up_bias), ex.host_bias(ffn.down_bias)
        plain = ffn is None or (ffn.act is None and gu_table is None and down_table is None)
        jobs = []
        for e, tok, col, pos in mine:
            self.places.append((e, tok * k + col, pos))
            gu_bias = None if gu_table is None else gu_table[e]
            jobs.append(
                ex.expert(
                    self.key0 + e,
                    local[e],
                    lambda gu, b=gu_bias: _hidden(gu, ffn, b),
                    None if down_table is None else down_table[e],
                    plain,
                )
            )
        self.batch = ex.submit(jobs, host, ready)

    def finish(
        self, x: torch.Tensor, weights: torch.Tensor
    ) -> list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """Wait for the batch; per CPU expert ``(positions [n], positions on x's device, y [n, H])``:
        its output scaled by its router weights (``weights [T, k]``) and cast to ``x``'s dtype, as
        the device paths do, on ``x``'s device, and the ``(token, rank)`` positions it fills."""
        t0 = time.perf_counter()
        results = self.batch.wait(self.executor.helps)
        self.stats.cpu_wait_s += time.perf_counter() - t0
        out = []
        w_flat = weights.reshape(-1)
        samples = self.executor.samples
        for (e, src, pos), (y, seconds) in zip(self.places, results):
            self.seconds[e] = seconds
            samples.append((len(src), seconds))
            if y.device != x.device:
                y = y.to(x.device, non_blocking=True)
            idx = upload(np.concatenate([src, pos]), x.device)  # one upload: weight and row index
            y = y * w_flat.index_select(0, idx[: len(src)]).unsqueeze(1)
            out.append((pos, idx[len(src) :], y if y.dtype == x.dtype else y.to(x.dtype)))
        self.stats.cpu_expert_s += sum(self.seconds.values())
        self.executor.start_samples.append(self.batch.start_s)
        self.batch, self.places = None, []
        return out

    def mask(self, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """``(on_cpu [E] bool, seconds [E])`` of the layer, for the per-request figures."""
        on_cpu = np.zeros(num_experts, dtype=bool)
        secs = np.zeros(num_experts)
        on_cpu[self.experts] = True
        for e, s in self.seconds.items():
            secs[e] = s
        return on_cpu, secs
