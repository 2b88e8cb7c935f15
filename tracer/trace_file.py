"""Trace files: one JSON line per finished request with its per-token routing.

The format (``moeserve-trace/1``) is documented in ``docs/trace-format.md``. In short, a line is::

    {"format": "moeserve-trace/1", "request_id": "r1", "task": "gsm8k", "prompt_len": 12,
     "num_layers": L, "num_experts": E, "top_k": k, "num_prefill": 12,
     "ids": [[[e, ...k] ...L] ...T], "weights": [[[w, ...k] ...L] ...T], "meta": {...}}

``ids[t][l]`` are the top-k expert ids of token ``t`` at MoE layer ``l`` (``-1`` = not recorded),
``weights`` the gate weights rounded to 4 decimals; the first ``num_prefill`` tokens are prompt
tokens, the rest generated ones. :meth:`TraceRecord.eam` rebuilds the EAMs (MoE-Infinity §4.1),
which is the input the simulator and :mod:`tracer.predict_eval` use.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracer.atomic import atomic_file
from tracer.eam import eam_from_choices
from tracer.errors import TracerError

FORMAT = "moeserve-trace/1"
WEIGHT_DECIMALS = 4


@dataclass(slots=True)
class TraceRecord:
    """One request's routing.

    Attributes:
        request_id: the request's id.
        task: task/dataset label, or None.
        prompt_len: prompt length in tokens, or None when unknown (e.g. imported logs).
        num_layers, num_experts, top_k: model shape ``L``, ``E``, ``k``.
        num_prefill: how many leading rows of ``ids`` are prompt tokens (0 when the prefill's
            routing was not captured, e.g. decode-only logs).
        ids: ``(T, L, k)`` int64 expert ids, ``-1`` = not recorded.
        weights: ``(T, L, k)`` float32 gate weights (0 where not recorded).
        meta: free-form JSON object (source file, ...).
    """

    request_id: str
    task: str | None
    prompt_len: int | None
    num_layers: int
    num_experts: int
    top_k: int
    num_prefill: int
    ids: np.ndarray
    weights: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """``T``, tokens traced (prompt + generated)."""
        return int(self.ids.shape[0])

    def eam(self, prefill: bool | None = None) -> np.ndarray:
        """``(L, E)`` int64 request EAM of the prompt tokens (``True``), the generated tokens
        (``False``) or all tokens (``None``); each choice counts once (row sum = tokens x k)."""
        if prefill is None:
            ids = self.ids
        else:
            ids = self.ids[: self.num_prefill] if prefill else self.ids[self.num_prefill :]
        return eam_from_choices(ids, self.num_experts)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this record (weights rounded to 4 decimals)."""
        obj: dict[str, Any] = {
            "format": FORMAT,
            "request_id": self.request_id,
            "task": self.task,
            "prompt_len": self.prompt_len,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_prefill": self.num_prefill,
            "ids": np.asarray(self.ids, dtype=np.int64).tolist(),
            "weights": np.round(np.asarray(self.weights, dtype=np.float64), WEIGHT_DECIMALS).tolist(),
        }
        if self.meta:
            obj["meta"] = self.meta
        return obj

    @classmethod
    def from_json(cls, obj: Any, where: str) -> TraceRecord:
        """Validate and build a record; ``where`` (``"file:line"``) prefixes error messages.

        Raises:
            TracerError: a field is missing, of the wrong type, or misshaped.
        """
        if not isinstance(obj, dict):
            raise TracerError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if obj.get("format") != FORMAT:
            raise TracerError(f"{where}: field 'format' is {obj.get('format')!r}, expected {FORMAT!r}")
        rid = _field(obj, "request_id", str, where)
        task = _field(obj, "task", str, where, optional=True)
        prompt_len = _field(obj, "prompt_len", int, where, optional=True)
        num_layers, num_experts, top_k = (
            _field(obj, f, int, where, low=1) for f in ("num_layers", "num_experts", "top_k")
        )
        num_prefill = _field(obj, "num_prefill", int, where, low=0)
        meta = obj.get("meta", {})
        if not isinstance(meta, dict):
            raise TracerError(f"{where}: field 'meta' must be an object")
        shape_tail = (num_layers, top_k)
        ids = _array(obj, "ids", np.int64, shape_tail, where)
        weights = _array(obj, "weights", np.float32, shape_tail, where)
        if weights.shape != ids.shape:
            raise TracerError(f"{where}: field 'weights' has shape {weights.shape}, 'ids' {ids.shape}")
        if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
            raise TracerError(
                f"{where}: field 'ids' holds {ids.min()}..{ids.max()}, outside [-1, {num_experts})"
            )
        if not np.isfinite(weights).all():
            raise TracerError(f"{where}: field 'weights' holds NaN or infinite values")
        if num_prefill > ids.shape[0]:
            raise TracerError(
                f"{where}: field 'num_prefill' is {num_prefill}, more than the {ids.shape[0]} tokens"
            )
        return cls(rid, task, prompt_len, num_layers, num_experts, top_k, num_prefill, ids, weights, meta)


def _field(
    obj: dict[str, Any], name: str, kind: type, where: str, optional: bool = False, low: int = 0
) -> Any:
    if name not in obj:
        raise TracerError(f"{where}: missing field '{name}'")
    value = obj[name]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < low):
        want = f"an int >= {low}" if kind is int else f"a {kind.__name__}"
        raise TracerError(
            f"{where}: field '{name}' must be {want}{' or null' if optional else ''}, got {value!r}"
        )
    return value


def _array(obj: dict[str, Any], name: str, dtype: type, tail: tuple[int, int], where: str) -> np.ndarray:
    if name not in obj:
        raise TracerError(f"{where}: missing field '{name}'")
    value = obj[name]
    if value == []:
        return np.zeros((0, *tail), dtype=dtype)
    try:
        arr = np.asarray(value, dtype=dtype)
    except (ValueError, TypeError) as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise TracerError(
            f"{where}: field '{name}' is not a (T, {tail[0]}, {tail[1]}) number array ({first})"
        ) from None
    if arr.ndim != 3 or arr.shape[1:] != tail:
        raise TracerError(
            f"{where}: field '{name}' has shape {arr.shape}, expected (T, {tail[0]}, {tail[1]})"
        )
    return arr


def iter_traces(path: str | Path) -> Iterator[TraceRecord]:
    """Yield the records of a trace file in order (blank lines skipped).

    Raises:
        TracerError: the file is missing, or a line is not JSON or not a valid record (the
            message names the file and the 1-based line number).
    """
    for where, obj in iter_json_lines(path, "trace file"):
        yield TraceRecord.from_json(obj, where)


def iter_json_lines(path: str | Path, what: str) -> Iterator[tuple[str, Any]]:
    """Yield ``("file:line", parsed JSON)`` for each non-blank line of a JSON-lines file.

    Raises:
        TracerError: the file is missing (``"<path>: no such <what>"``) or a line is not JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise TracerError(f"{path}: no such {what}")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise TracerError(f"{where}: bad JSON ({exc.msg}, column {exc.colno})") from None


def load_traces(path: str | Path) -> list[TraceRecord]:
    """All records of a trace file; see :func:`iter_traces` for the errors."""
    return list(iter_traces(path))


class TraceWriter:
    """Appends one JSON line per record to ``path``; thread-safe, flushed after every line.

    Args:
        path: the trace file (created with its folders if missing, appended to otherwise).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")
        self.written = 0

    def write(self, record: TraceRecord) -> None:
        """Append ``record`` as one line and flush.

        Raises:
            ValueError: the writer is closed.
        """
        line = json.dumps(record.to_json(), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"trace writer for {self.path} is closed")
            self._file.write(line)
            self._file.flush()
            self.written += 1

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_traces(path: str | Path, records: list[TraceRecord]) -> None:
    """Write ``records`` to a new file at ``path`` atomically (temp file + ``os.replace``)."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")
