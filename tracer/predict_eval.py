"""How well can the experts of layer ``l + d`` be predicted while layer ``l`` runs? (MoE-Infinity
§5.1 prefetching, §7.2 "model-level tracing" comparison), measured offline on trace files.

NOTE: protocol. An EAMC is filled with the request EAMs (prefill + decode) of the *warm*
requests. Each *eval* request is then replayed token by token over its generated tokens (decode
steps; the first traced token is skipped because the previous-token baseline needs a previous
step). At generated token ``t`` and MoE layer ``l``, each method predicts ``m`` experts
(``m = top_k`` unless told) for layer ``l + d`` (``d`` = 1, 2, 3, ``l + d < L``):

* **eamc** -- query = the request's EAM so far (all earlier tokens, prompt included, all layers)
  plus token ``t``'s layers ``0..l``; the ``matches`` most similar entries (per-layer cosine,
  :class:`tracer.eamc.EAMC`) are summed and row-normalised into activation probabilities, and the
  ``m`` most probable experts of layer ``l + d`` are predicted (§5.1 steps 1-2).
* **model-counts** -- BrainStorm/DeepUM-style lifetime counts: every warm token plus every eval
  token seen so far, per expert; the ``m`` most counted experts of layer ``l + d``.
* **prev-token** -- the ``k`` experts the previous token chose at layer ``l + d``.
* **request-eam** -- the ``m`` experts the request itself used most so far at layer ``l + d``
  (its request EAM; the within-request skew that MoE-Infinity's cache priorities use, §5.2).

The actual set is the experts token ``t`` chose at layer ``l + d``. Precision = hits / predicted,
recall = hits / actual, both summed over all (token, layer) events before dividing. With
``m = top_k`` a single-token step predicts and needs ``k`` experts, so precision equals recall.
Ties are broken towards the lower expert id. Unrecorded cells (``-1``) are skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracer.eam import eam_from_choices
from tracer.eamc import EAMC
from tracer.errors import TracerError
from tracer.trace_file import TraceRecord

METHODS = ("eamc", "model-counts", "prev-token", "request-eam")


def _onehot_choices(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``(..., k)`` ids (``-1`` = none) -> ``(..., E)`` bool membership."""
    out = np.zeros((*ids.shape[:-1], num_experts + 1), dtype=bool)
    np.put_along_axis(out, np.where(ids < 0, num_experts, ids), True, axis=-1)
    return out[..., :num_experts]


def _top_m(scores: np.ndarray, m: int) -> np.ndarray:
    """``(..., E)`` scores -> ``(..., E)`` bool of the ``m`` highest (ties: lower id); all-zero
    rows predict nothing."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :m]
    out = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(out, order, True, axis=-1)
    return out & (scores.max(axis=-1, keepdims=True) > 0)


class _Tally:
    def __init__(self) -> None:
        self.hits = self.predicted = self.actual = self.events = 0

    def add(self, pred: np.ndarray, actual: np.ndarray, valid: np.ndarray) -> None:
        pred, actual = pred[valid], actual[valid]
        self.hits += int((pred & actual).sum())
        self.predicted += int(pred.sum())
        self.actual += int(actual.sum())
        self.events += int(valid.sum())

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": round(self.hits / self.predicted, 4) if self.predicted else None,
            "recall": round(self.hits / self.actual, 4) if self.actual else None,
            "events": self.events,
        }


def evaluate(
    warm: list[TraceRecord],
    eval_records: list[TraceRecord],
    distances: tuple[int, ...] = (1, 2, 3),
    matches: int = 4,
    predict_k: int | None = None,
    capacity: int = 1000,
    online: bool = False,
) -> dict[str, Any]:
    """Run the protocol of the module docstring.

    Args:
        warm: requests whose EAMs fill the EAMC (and the lifetime counts).
        eval_records: requests to predict.
        distances: layers ahead.
        matches: EAMC entries aggregated per query.
        predict_k: ``m``, experts predicted per layer (default: the model's ``top_k``).
        capacity: EAMC capacity.
        online: also add each eval request to the EAMC after it was evaluated.

    Returns:
        ``{"settings": {...}, "rows": [{"method", "d", "precision", "recall", "events"}, ...]}``.

    Raises:
        TracerError: no eval records, or warm and eval records of different model shapes.
    """
    if not eval_records:
        raise TracerError("predict-eval: no eval requests")
    shape = (eval_records[0].num_layers, eval_records[0].num_experts, eval_records[0].top_k)
    for rec in [*warm, *eval_records]:
        if (rec.num_layers, rec.num_experts, rec.top_k) != shape:
            raise TracerError(
                f"predict-eval: request {rec.request_id} is of shape (L, E, k) = "
                f"{(rec.num_layers, rec.num_experts, rec.top_k)}, others {shape}"
            )
    num_layers, num_experts, top_k = shape
    m = predict_k or top_k
    distances = tuple(d for d in distances if 0 < d < num_layers)
    eamc = EAMC(num_layers, num_experts, capacity=capacity)
    lifetime = np.zeros((num_layers, num_experts), dtype=np.float64)
    for rec in warm:
        total = rec.eam()
        lifetime += total
        if total.any():
            eamc.add(total)
    tallies = {(meth, d): _Tally() for meth in METHODS for d in distances}
    tokens = 0
    for rec in eval_records:
        tok_onehot = _onehot_choices(rec.ids, num_experts)  # [T, L, E]
        cum = np.zeros((rec.num_tokens + 1, num_layers, num_experts), dtype=np.float32)
        np.cumsum(tok_onehot, axis=0, out=cum[1:])  # cum[t] = counts of tokens < t
        lifetime += cum[min(rec.num_prefill, rec.num_tokens)]  # the prompt counts before decoding
        for t in range(max(1, rec.num_prefill), rec.num_tokens):
            tokens += 1
            _predict_token(eamc, rec, t, tok_onehot, cum, lifetime, distances, matches, m, tallies)
            lifetime += tok_onehot[t]
        if online and rec.ids.size:
            eamc.add(eam_from_choices(rec.ids, num_experts))
    settings = {
        "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k, "predict_k": m,
        "matches": matches, "capacity": capacity, "online": online,
        "warm_requests": len(warm), "eamc_entries": len(eamc),
        "eval_requests": len(eval_records), "eval_tokens": tokens,
    }  # fmt: skip
    rows = [{"method": meth, "d": d, **tallies[(meth, d)].as_dict()} for meth in METHODS for d in distances]
    return {"settings": settings, "rows": rows}


def _predict_token(
    eamc: EAMC,
    rec: TraceRecord,
    t: int,
    tok_onehot: np.ndarray,
    cum: np.ndarray,
    lifetime: np.ndarray,
    distances: tuple[int, ...],
    matches: int,
    m: int,
    tallies: dict[tuple[str, int], _Tally],
) -> None:
    """Score every method at token ``t`` for every layer ``l`` and distance ``d``."""
    num_layers = rec.num_layers
    upto = np.arange(num_layers)[:, None] >= np.arange(num_layers)[None, :]  # [l, row]: row <= l
    queries = cum[t][None] + upto[:, :, None] * tok_onehot[t][None]  # [L(l), L, E]
    agg = None
    if len(eamc):
        _, idx = eamc.search(queries, k=matches)  # [L, matches]
        agg = eamc.entries()[idx].sum(axis=1)  # [L(l), L, E]
        sums = agg.sum(axis=-1, keepdims=True)
        agg = np.divide(agg, sums, out=np.zeros_like(agg), where=sums > 0)
    for d in distances:
        src = np.arange(num_layers - d)  # l
        dst = src + d  # l + d
        actual = tok_onehot[t, dst]  # [L-d, E]
        valid = actual.any(axis=-1)
        if agg is not None:
            tallies[("eamc", d)].add(_top_m(agg[src, dst], m), actual, valid)
        else:
            tallies[("eamc", d)].add(np.zeros_like(actual), actual, valid)
        tallies[("model-counts", d)].add(_top_m(lifetime[dst], m), actual, valid)
        tallies[("prev-token", d)].add(tok_onehot[t - 1, dst], actual, valid)
        tallies[("request-eam", d)].add(_top_m(cum[t, dst], m), actual, valid)


def print_eval(result: dict[str, Any]) -> None:
    """Render :func:`evaluate` output as a rich table (precision / recall per method and ``d``)."""
    from richconsole import Table, make_console

    s = result["settings"]
    console = make_console()
    console.print("predict-eval  " + "  ".join(f"{k}={v}" for k, v in s.items()))
    table = Table("method", "d", "precision", "recall", "events")
    for r in result["rows"]:
        p, q = r["precision"], r["recall"]
        table.add_row(
            r["method"],
            str(r["d"]),
            "-" if p is None else f"{p:.3f}",
            "-" if q is None else f"{q:.3f}",
            str(r["events"]),
        )
    console.print(table)
