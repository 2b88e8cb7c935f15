"""The simulator's workload: trace records (``tracer`` format), split into warm and eval parts.

A trace file (``docs/trace-format.md``; written by the runtime's tracer or ``moeserve trace
import``) holds per request the top-k expert ids of every token at every MoE layer, prompt tokens
first. The simulator replays them as the engine would have run them: each request's first step
computes its ``num_prefill`` prompt rows (if any), every later step one row. Like ``moeserve bench
policies``, a *warm* part (the first ``warm`` requests of every task) fills the EAMC and warms the
learned baselines, and the disjoint *eval* part is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_runtime.errors import ConfigError
from tracer.errors import TracerError
from tracer.trace_file import TraceRecord, load_traces


@dataclass(slots=True)
class SimRequest:
    """One traced request: ``ids (T, L, k)`` int64 (``-1`` = not recorded), ``weights`` alike
    float32, the first ``num_prefill`` rows prompt tokens."""

    request_id: str
    task: str | None
    ids: np.ndarray
    weights: np.ndarray
    num_prefill: int

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def output_tokens(self) -> int:
        """Tokens the request generated: one per decode row, plus the token its prefill samples."""
        return self.num_rows - self.num_prefill + (1 if self.num_prefill else 0)


@dataclass(slots=True)
class Workload:
    """Shape ``(L, E, k)``, source path, and the requests in file order."""

    path: str
    num_layers: int
    num_experts: int
    top_k: int
    requests: list[SimRequest]

    @property
    def tasks(self) -> list[str]:
        return sorted({r.task or "-" for r in self.requests})


def load_workload(path: str | Path) -> Workload:
    """Read a trace file; all records must share one ``(L, E, k)``.

    Raises:
        ConfigError: missing or malformed file (the message names the file and line), an empty
            file, or records of different shapes.
    """
    try:
        records: list[TraceRecord] = load_traces(path)
    except TracerError as exc:
        raise ConfigError(f"--trace: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--trace {path}: cannot read ({exc})") from None
    if not records:
        raise ConfigError(f"--trace {path}: no trace records")
    shape = (records[0].num_layers, records[0].num_experts, records[0].top_k)
    reqs: list[SimRequest] = []
    for r in records:
        if (r.num_layers, r.num_experts, r.top_k) != shape:
            raise ConfigError(
                f"--trace {path}: request {r.request_id!r} has L={r.num_layers} E={r.num_experts} "
                f"k={r.top_k}, the first has L={shape[0]} E={shape[1]} k={shape[2]}"
            )
        if r.num_tokens == 0:
            continue
        reqs.append(SimRequest(r.request_id, r.task, r.ids.astype(np.int64), r.weights, r.num_prefill))
    if not reqs:
        raise ConfigError(f"--trace {path}: every record is empty")
    return Workload(str(path), *shape, reqs)


def split_warm_eval(
    workload: Workload, warm_per_task: int, pick: str = "first"
) -> tuple[list[SimRequest], list[SimRequest]]:
    """Per task, ``warm_per_task`` requests warm (the first ones, or the last with ``pick="last"``)
    and the rest are measured; task order and file order are kept.

    Raises:
        ConfigError: the split leaves nothing to measure.
    """
    if pick not in ("first", "last"):
        raise ConfigError(f"--warm-pick must be 'first' or 'last', got {pick!r}")
    by_task: dict[str, list[SimRequest]] = {}
    for r in workload.requests:
        by_task.setdefault(r.task or "-", []).append(r)
    warm_ids: set[str] = set()
    for reqs in by_task.values():
        n = min(warm_per_task, len(reqs))
        chosen = reqs[:n] if pick == "first" else reqs[len(reqs) - n :]
        warm_ids.update(r.request_id for r in chosen)
    warm = [r for r in workload.requests if r.request_id in warm_ids]
    evals = [r for r in workload.requests if r.request_id not in warm_ids]
    if not evals:
        raise ConfigError(
            f"--warm {warm_per_task} leaves no request to measure in {workload.path} "
            f"({len(workload.requests)} requests over tasks {', '.join(by_task)})"
        )
    return warm, evals


def split_requests(requests: list[SimRequest], n: int) -> list[SimRequest]:
    """``requests`` cut into ``n`` sequences of consecutive rows (each request into pieces by its
    share of the rows, at least one; a prompt stays in its request's first piece), so that a batch
    of ``n`` has ``n`` token streams when the trace holds fewer requests. Unchanged when ``n`` is
    at most ``len(requests)``."""
    if n <= len(requests):
        return list(requests)
    lengths = np.asarray([r.num_rows - r.num_prefill for r in requests], dtype=np.float64)
    extra = n - len(requests)
    share = extra * lengths / lengths.sum()
    pieces = 1 + np.floor(share).astype(int)
    for i in np.argsort(-(share - np.floor(share)), kind="stable")[: n - int(pieces.sum())]:
        pieces[i] += 1  # the largest remainders take the pieces left
    out = []
    for r, k in zip(requests, pieces.tolist()):
        k = max(1, min(k, r.num_rows - r.num_prefill))
        bounds = np.linspace(r.num_prefill, r.num_rows, k + 1).round().astype(int)
        bounds[0] = 0
        for j in range(k):
            a, b = bounds[j], bounds[j + 1]
            prefill = r.num_prefill if j == 0 else 0
            out.append(SimRequest(f"{r.request_id}/{j}", r.task, r.ids[a:b], r.weights[a:b], prefill))
    return out


def with_prompts(requests: list[SimRequest], tokens: int, pool: list[SimRequest]) -> list[SimRequest]:
    """``requests`` each with a ``tokens``-row prompt before its rows, whose routing is ``pool``'s
    rows in order (all its requests' rows concatenated, request ``i`` starting at row
    ``i x tokens``, cyclically): a stand-in for prompt routing where a trace holds none."""
    ids = np.concatenate([r.ids for r in pool])
    weights = np.concatenate([r.weights for r in pool])
    out = []
    for i, r in enumerate(requests):
        rows = (i * tokens + np.arange(tokens)) % len(ids)
        out.append(
            SimRequest(
                r.request_id,
                r.task,
                np.concatenate([ids[rows], r.ids]),
                np.concatenate([weights[rows], r.weights]),
                r.num_prefill + tokens,
            )
        )
    return out
