"""Import per-token routing logs (one JSON line per request, layer and token) as trace records.

Source format (``shared/data/routing_traces/*/*_routing.jsonl``, logged from vLLM)::

    {"dataset": "gsm8k", "problem_id": 0, "layer": 0, "token_idx": 0,
     "experts": [7, 0], "gating_probs": [0.80, 0.20]}

one line per (request, MoE layer, generated token). Lines of one request are grouped by
``(dataset, problem_id)`` and become one :class:`tracer.trace_file.TraceRecord` with
``request_id = "<dataset>-<problem_id>"``, ``task = dataset``, ``num_prefill = 0`` (only generated
tokens were logged; the prompt's routing is not in the log) and ``prompt_len = None`` (the log
holds no prompt token count). ``T`` is the largest ``token_idx`` + 1 over the request's layers; a
(token, layer) cell absent from the log is stored as ids ``-1`` (such logs often miss the last
token or two at some layers) and counted in ``meta["missing_cells"]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tracer.errors import TracerError
from tracer.trace_file import TraceRecord, iter_json_lines

_FIELDS = ("dataset", "problem_id", "layer", "token_idx", "experts", "gating_probs")


def _parse(path: Path) -> dict[tuple[str, int], list[tuple[int, int, list[int], list[float], str]]]:
    groups: dict[tuple[str, int], list[tuple[int, int, list[int], list[float], str]]] = {}
    for where, obj in iter_json_lines(path, "routing log"):
        if not isinstance(obj, dict):
            raise TracerError(f"{where}: expected a JSON object")
        for name in _FIELDS:
            if name not in obj:
                raise TracerError(f"{where}: missing field '{name}'")
        layer, tok, experts, probs = obj["layer"], obj["token_idx"], obj["experts"], obj["gating_probs"]
        if not (isinstance(layer, int) and layer >= 0 and isinstance(tok, int) and tok >= 0):
            raise TracerError(f"{where}: fields 'layer'/'token_idx' must be ints >= 0, got {layer!r}/{tok!r}")
        if (
            not isinstance(experts, list)
            or not experts
            or not all(isinstance(e, int) and e >= 0 for e in experts)
            or not isinstance(probs, list)
            or len(probs) != len(experts)
            or not all(isinstance(p, (int, float)) for p in probs)
        ):
            raise TracerError(
                f"{where}: fields 'experts'/'gating_probs' must be equal-length id/number lists"
            )
        key = (str(obj["dataset"]), int(obj["problem_id"]))
        groups.setdefault(key, []).append((layer, tok, experts, probs, where))
    return groups


def _to_record(
    path: Path,
    key: tuple[str, int],
    rows: list[tuple[int, int, list[int], list[float], str]],
    num_experts: int,
) -> TraceRecord:
    dataset, problem = key
    top_k = len(rows[0][2])
    num_layers = 1 + max(r[0] for r in rows)
    num_tokens = 1 + max(r[1] for r in rows)
    ids = np.full((num_tokens, num_layers, top_k), -1, dtype=np.int64)
    weights = np.zeros((num_tokens, num_layers, top_k), dtype=np.float32)
    for layer, tok, experts, probs, where in rows:
        if len(experts) != top_k:
            raise TracerError(f"{where}: {len(experts)} experts, the request's other lines have {top_k}")
        if max(experts) >= num_experts:
            raise TracerError(f"{where}: expert id {max(experts)} >= num_experts {num_experts}")
        if ids[tok, layer, 0] != -1:
            raise TracerError(f"{where}: duplicate line for token {tok} at layer {layer}")
        ids[tok, layer] = experts
        weights[tok, layer] = probs
    missing = int((ids[:, :, 0] < 0).sum())
    meta: dict[str, Any] = {
        "source": str(path),
        "dataset": dataset,
        "problem_id": problem,
        "missing_cells": missing,
    }
    return TraceRecord(
        request_id=f"{dataset}-{problem}",
        task=dataset,
        prompt_len=None,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        num_prefill=0,
        ids=ids,
        weights=weights,
        meta=meta,
    )


def import_routing(paths: Iterable[str | Path], num_experts: int | None = None) -> list[TraceRecord]:
    """Read routing logs and return one trace record per request, in order of first appearance.

    Args:
        paths: ``*_routing.jsonl`` files.
        num_experts: ``E``; default: the largest expert id seen + 1, over all files.

    Returns:
        Records sharing one model shape (``L`` = layers seen, ``E``, ``k``).

    Raises:
        TracerError: a file is missing, a line is not valid (names file and line), or the files
            disagree on the number of layers or ``top_k``.
    """
    parsed = [(Path(p), _parse(Path(p))) for p in paths]
    if not any(groups for _, groups in parsed):
        raise TracerError("no routing lines in " + ", ".join(str(p) for p, _ in parsed))
    seen_max = max(max(r[2]) for _, groups in parsed for rows in groups.values() for r in rows)
    num_experts = num_experts or seen_max + 1
    records = [
        _to_record(path, key, rows, num_experts) for path, groups in parsed for key, rows in groups.items()
    ]
    num_layers = max(r.num_layers for r in records)
    for rec in records:
        if rec.top_k != records[0].top_k:
            raise TracerError(
                f"{rec.meta['source']}: request {rec.request_id} has top_k {rec.top_k}, "
                f"others {records[0].top_k}"
            )
        if rec.num_layers < num_layers:  # a request whose last layers never appear: pad as missing
            pad = num_layers - rec.num_layers
            rec.ids = np.concatenate(
                [rec.ids, np.full((rec.num_tokens, pad, rec.top_k), -1, np.int64)], axis=1
            )
            rec.weights = np.concatenate(
                [rec.weights, np.zeros((rec.num_tokens, pad, rec.top_k), np.float32)], axis=1
            )
            rec.meta["missing_cells"] += rec.num_tokens * pad
            rec.num_layers = num_layers
    return records
