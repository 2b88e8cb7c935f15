"""What expert slots buy: the expert buffer's hits per decode step by its slots and the batch.

The memory plan (:mod:`moe_runtime.memory_split`) weighs KV blocks against expert slots; this module
gives the slots' side, MoE-Lightning's idea (HRM, §4.2: a performance model from the model's shape
and the hardware, no measured fit) applied to an offloaded expert buffer.

**Model.** A decode token picks expert ``e`` of MoE layer ``l`` with probability ``pi[l, e]``
(``sum_e pi[l, e] = k``, each at most 1). A step of ``C`` sequences needs the expert with
probability ``q = 1 - prod_r (1 - pi_r[l, e])`` over its sequences ``r``; ``sum q`` is the expected
number of distinct experts the step needs over all layers. A buffer of ``S`` slots holding the
``S`` experts of highest ``q`` (what a cache that knows the batch keeps; no prefetch) hits
``sum`` of those ``q``: :meth:`StepDemand.hits`. Hit rate is hits over distinct needs, which falls
as ``C`` grows (a batch spreads over more experts). A dynamic cache that exploits a request's reuse
over its tokens, and prefetching, do better, so the curve is an estimate from below.

**Routing probabilities.**

- No data (:func:`default_routing`): every layer the same Zipf law over its experts, ``pi`` of
  the ``i``-th most used proportional to ``i ** -s``, scaled to ``k`` and capped at 1. ``s`` grows
  with the experts per choice, ``s = 0.5 + 0.21 * (log2(E / k) - 2)``, clamped to [0, 1.6]: a
  least-squares fit to the expert activation ratios over batch sizes 2-32 of MoE-Infinity's
  Table 1 (``../shared/papers/003_*``; Mixtral-8x7B, ``E/k = 4``: ``s = 0.5``; NLLB and Arctic,
  128 experts top-2: 1.0 and 1.45; Switch, 128 top-1: 1.55). Qwen3-30B-A3B (128 experts, top-8)
  gets 0.92, Mixtral 0.5.
- With data (:func:`routing_from_eams`): one ``pi`` per recorded request, its EAM (MoE-Infinity
  §4.1) divided by its tokens; a step's ``C`` sequences are drawn from them (fixed seed, the mean
  over :data:`DRAWS` draws), so the requests' own skew and their overlap come from the traffic.
  :mod:`moe_runtime.plan_data` reads them from a trace file or an EAMC file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Batches drawn per concurrency when the routing has one profile per recorded request.
DRAWS = 8


def zipf_exponent(num_experts: int, top_k: int) -> float:
    """The default routing's skew ``s`` for ``E`` experts of which ``k`` are chosen (see the
    module docstring for the fit)."""
    return min(1.6, max(0.0, 0.5 + 0.21 * (math.log2(num_experts / top_k) - 2)))


def capped(weights: np.ndarray, top_k: int) -> np.ndarray:
    """``weights`` (last axis: experts) scaled so each row sums to ``top_k`` with no entry above 1
    (water-filling: a capped entry's excess goes to the others in proportion)."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum(axis=-1, keepdims=True)
    p = np.divide(w * top_k, total, out=np.zeros_like(w), where=total > 0)
    for _ in range(p.shape[-1]):
        over = p > 1
        if not over.any():
            break
        p = np.minimum(p, 1.0)
        free = np.where(p < 1, p, 0.0)
        room = top_k - (p >= 1).sum(axis=-1, keepdims=True)
        s = free.sum(axis=-1, keepdims=True)
        p = np.where(p < 1, np.divide(free * room, s, out=np.zeros_like(free), where=s > 0), 1.0)
    return np.minimum(p, 1.0)


@dataclass(frozen=True)
class RoutingModel:
    """Per-token expert probabilities of a model's traffic.

    Attributes:
        profiles: ``(R, L', E)`` float64, one row set per recorded request (``R = 1`` without
            data); each ``[r, l]`` sums to at most ``k``.
        repeat: how many MoE layers each of the ``L'`` layers stands for (``L`` when one profile
            serves every layer, else 1).
        source: where the probabilities come from, for the load summary.
    """

    profiles: np.ndarray
    repeat: int
    source: str

    def demand(self, concurrency: int, seed: int = 0) -> StepDemand:
        """The expected needs of one decode step of ``concurrency`` sequences."""
        r = self.profiles.shape[0]
        with np.errstate(divide="ignore"):
            logs = np.log1p(-np.minimum(self.profiles, 1.0))  # -inf where a pick is certain
        if r == 1:
            mean = -np.expm1(concurrency * logs[0]).ravel()
        else:
            rng = np.random.default_rng(seed)
            acc = np.zeros(logs.shape[1] * logs.shape[2])
            for _ in range(DRAWS):
                pick = rng.integers(0, r, size=concurrency)
                counts = np.bincount(pick, minlength=r)
                used = np.nonzero(counts)[0]
                summed = np.tensordot(counts[used].astype(np.float64), logs[used], axes=1)
                acc += np.sort(-np.expm1(summed).ravel())[::-1]
            mean = acc / DRAWS
        ordered = np.sort(mean)[::-1]
        return StepDemand(concurrency, np.concatenate([[0.0], np.cumsum(ordered)]), ordered, self.repeat)


@dataclass(frozen=True)
class StepDemand:
    """Experts one decode step of ``concurrency`` sequences needs (expected, all MoE layers).

    Attributes:
        concurrency: sequences in the step.
        cumulative: ``[0, q1, q1 + q2, ...]`` of one profile's need probabilities, highest first.
        ordered: those probabilities, highest first.
        repeat: layers each probability stands for (each value counts ``repeat`` times).
    """

    concurrency: int
    cumulative: np.ndarray
    ordered: np.ndarray
    repeat: int

    @property
    def distinct(self) -> float:
        """Expected distinct (layer, expert) pairs the step needs."""
        return float(self.cumulative[-1]) * self.repeat

    def hits(self, slots: int) -> float:
        """Expected needs the ``slots`` most needed experts cover (each value ``repeat`` times)."""
        whole, part = divmod(max(0, slots), self.repeat)
        if whole >= len(self.ordered):
            return self.distinct
        return self.repeat * float(self.cumulative[whole]) + part * float(self.ordered[whole])

    def misses(self, slots: int) -> float:
        """Expected experts the step copies in (needed, not among the ``slots`` held)."""
        return max(0.0, self.distinct - self.hits(slots))

    def hit_rate(self, slots: int) -> float:
        """Share of the step's needed experts the ``slots`` hold, in [0, 1]."""
        d = self.distinct
        return self.hits(slots) / d if d > 0 else 1.0


def default_routing(num_layers: int, num_experts: int, top_k: int) -> RoutingModel:
    """The no-data routing: one Zipf profile for every layer (module docstring)."""
    s = zipf_exponent(num_experts, top_k)
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -s
    profile = capped(weights, top_k)[None, None, :]
    return RoutingModel(profile, num_layers, f"Zipf s={s:.2f} over {num_experts} experts, top-{top_k}")


def routing_from_eams(eams: np.ndarray, top_k: int, source: str) -> RoutingModel:
    """Routing from per-request EAMs ``(R, L, E)`` (token counts, or an EAMC's L2-normalised
    rows: only each row's shape matters): each row scaled to ``k`` picks per token.

    Raises:
        ValueError: no request, or one whose every row is empty.
    """
    eams = np.asarray(eams, dtype=np.float64)
    keep = eams.sum(axis=(1, 2)) > 0
    if eams.ndim != 3 or not keep.any():
        raise ValueError("no request with a recorded expert choice")
    return RoutingModel(capped(eams[keep], top_k), 1, source)
