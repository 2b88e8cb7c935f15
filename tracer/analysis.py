"""Trace statistics behind MoE-Infinity's design (§3.1 observations, measured on our traces).

* **Activation ratio** -- share of a layer's experts a request activates at least once, averaged
  over layers, per request, for its prompt tokens and its generated tokens separately.
* **Within-request skew** -- share of a request's activations at a layer that go to its top 25 %
  experts (``ceil(E / 4)`` of them), averaged over layers; compared with the same figure for the
  model-level counts (all requests summed), which the paper finds close to uniform (= 0.25).
* **Cross-layer correlation** -- for each pair of consecutive layers ``(l, l+1)``, the joint
  distribution of (expert at ``l``, expert at ``l+1``) over all tokens, each token contributing
  its ``k x k`` choice pairs. Reported: normalised mutual information
  ``I(A;B) / sqrt(H(A) H(B))`` (plug-in estimate, biased upwards on small samples, so the same
  figure with layer ``l+1`` shuffled across tokens is given as the noise floor), and the
  conditional hit rate ``sum_a P(a) max_b P(b | a)`` (how often the most likely next expert given
  the current one is right, per choice pair) next to the marginal ``max_b P(b)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tracer.trace_file import TraceRecord


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "median": None, "min": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "n": len(values),
        "mean": round(float(arr.mean()), 4),
        "median": round(float(np.median(arr)), 4),
        "min": round(float(arr.min()), 4),
        "max": round(float(arr.max()), 4),
    }


def activation_ratio(eam: np.ndarray) -> float:
    """Mean over layers of the share of experts with a non-zero count in ``eam (L, E)``."""
    return float((np.asarray(eam) > 0).mean())


def top_quarter_share(eam: np.ndarray) -> float | None:
    """Mean over non-empty layers of the share of the row held by its ``ceil(E/4)`` largest counts."""
    eam = np.asarray(eam, dtype=np.float64)
    top = math.ceil(eam.shape[1] / 4)
    sums = eam.sum(axis=1)
    keep = sums > 0
    if not keep.any():
        return None
    head = np.sort(eam[keep], axis=1)[:, -top:].sum(axis=1)
    return float((head / sums[keep]).mean())


def _nmi(joint: np.ndarray) -> float | None:
    total = joint.sum()
    if total == 0:
        return None
    p = joint / total
    pa, pb = p.sum(axis=1), p.sum(axis=0)
    nz = p > 0
    mi = float((p[nz] * np.log(p[nz] / np.outer(pa, pb)[nz])).sum())
    ha = -float((pa[pa > 0] * np.log(pa[pa > 0])).sum())
    hb = -float((pb[pb > 0] * np.log(pb[pb > 0])).sum())
    return mi / math.sqrt(ha * hb) if ha > 0 and hb > 0 else None


def _joint(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """``(E, E)`` counts of (a-choice, b-choice) pairs over tokens with both layers recorded."""
    ok = (a >= 0).all(axis=1) & (b >= 0).all(axis=1)
    key = (a[ok][:, :, None] * num_experts + b[ok][:, None, :]).ravel()
    return np.bincount(key, minlength=num_experts * num_experts).reshape(num_experts, num_experts)


def cross_layer(ids: np.ndarray, num_experts: int, seed: int = 0) -> dict[str, Any]:
    """Cross-layer statistics of ``ids (N, L, k)`` (all tokens of all requests)."""
    rng = np.random.default_rng(seed)
    nmi, floor, cond, marg = [], [], [], []
    for layer in range(ids.shape[1] - 1):
        a, b = ids[:, layer], ids[:, layer + 1]
        joint = _joint(a, b, num_experts)
        if joint.sum() == 0:
            continue
        v = _nmi(joint)
        if v is not None:
            nmi.append(v)
        s = _nmi(_joint(a, b[rng.permutation(len(b))], num_experts))
        if s is not None:
            floor.append(s)
        p = joint / joint.sum()
        cond.append(float(p.max(axis=1).sum()))
        marg.append(float(p.sum(axis=0).max()))
    return {
        "nmi": _summary(nmi),
        "nmi_shuffled": _summary(floor),
        "cond_top1": _summary(cond),
        "marginal_top1": _summary(marg),
    }


def trace_stats(records: list[TraceRecord]) -> dict[str, Any]:
    """All statistics of a list of records sharing one model shape (see the module docstring).

    Raises:
        ValueError: no records, or records of different model shapes.
    """
    if not records:
        raise ValueError("no trace records")
    shape = (records[0].num_layers, records[0].num_experts, records[0].top_k)
    for rec in records:
        got = (rec.num_layers, rec.num_experts, rec.top_k)
        if got != shape:
            raise ValueError(f"request {rec.request_id} has shape {got}, others {shape}")
    num_layers, num_experts, top_k = shape
    out: dict[str, Any] = {
        "model": {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k},
        "requests": len(records),
        "tokens": {
            "prefill": sum(r.num_prefill for r in records),
            "decode": sum(r.num_tokens - r.num_prefill for r in records),
        },
    }
    ratio: dict[str, list[float]] = {"prefill": [], "decode": []}
    skew: dict[str, list[float]] = {"prefill": [], "decode": [], "all": []}
    model = np.zeros((num_layers, num_experts), dtype=np.int64)
    for rec in records:
        for phase, flag in (("prefill", True), ("decode", False)):
            eam = rec.eam(prefill=flag)
            if eam.any():
                ratio[phase].append(activation_ratio(eam))
                s = top_quarter_share(eam)
                if s is not None:
                    skew[phase].append(s)
        total = rec.eam()
        model += total
        s = top_quarter_share(total)
        if s is not None:
            skew["all"].append(s)
    out["activation_ratio"] = {phase: _summary(v) for phase, v in ratio.items()}
    out["skew_top25"] = {
        **{f"request_{phase}": _summary(v) for phase, v in skew.items()},
        "model_level": round(top_quarter_share(model) or 0.0, 4),
        "uniform": round(math.ceil(num_experts / 4) / num_experts, 4),
    }
    ids = np.concatenate([r.ids for r in records])
    out["cross_layer"] = cross_layer(ids, num_experts)
    return out


def print_stats(stats: dict[str, Any], title: str = "") -> None:
    """Render :func:`trace_stats` output as rich tables."""
    from richconsole import Table, make_console

    console = make_console()
    m, tok = stats["model"], stats["tokens"]
    console.print(
        f"{title}  L={m['num_layers']} E={m['num_experts']} top_k={m['top_k']}  "
        f"requests={stats['requests']}  "
        f"tokens: prefill={tok['prefill']} decode={tok['decode']}"
    )

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    t = Table("figure", "requests", "mean", "median", "min", "max", title="per request (MoE-Infinity §3.1)")
    rows = [
        ("activation ratio, prefill", stats["activation_ratio"]["prefill"]),
        ("activation ratio, decode", stats["activation_ratio"]["decode"]),
        ("top-25% expert share, prefill", stats["skew_top25"]["request_prefill"]),
        ("top-25% expert share, decode", stats["skew_top25"]["request_decode"]),
        ("top-25% expert share, all tokens", stats["skew_top25"]["request_all"]),
    ]
    for name, s in rows:
        t.add_row(name, str(s["n"]), fmt(s["mean"]), fmt(s["median"]), fmt(s["min"]), fmt(s["max"]))
    console.print(t)
    sk = stats["skew_top25"]
    console.print(
        f"top-25% expert share of the model-level counts: {sk['model_level']:.3f} "
        f"(uniform: {sk['uniform']:.3f})"
    )
    t = Table("figure (layer l -> l+1)", "mean", "min", "max", title="cross-layer correlation")
    cl = stats["cross_layer"]
    for name, key in (
        ("normalised mutual information", "nmi"),
        ("  same, l+1 shuffled (noise floor)", "nmi_shuffled"),
        ("P(next = most likely given current)", "cond_top1"),
        ("  same, ignoring current (marginal)", "marginal_top1"),
    ):
        s = cl[key]
        t.add_row(name, fmt(s["mean"]), fmt(s["min"]), fmt(s["max"]))
    console.print(t)
