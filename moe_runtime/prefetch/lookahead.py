"""The router lookahead in the ``eam`` plan (our addition, not in MoE-Infinity).

With ``lookahead >= 1`` the plan for the next ``lookahead`` layers also uses the router lookahead
(``moe_runtime.layers.router_lookahead``: those layers' routers applied to the current residual
stream, Mixtral-Offloading's speculative loading): its expected token counts, row-normalised, are
added with weight ``lookahead_weight`` to the EAMC probabilities of those layers
(``eam_kernels.blend``, which the gate's compiled call runs inside the plan). The EAMC alone
still plans the layers further away; without lookahead scores (the simulator replays routing
only, and models the lookahead as a predictor of a given precision) the plan is the paper's
(:mod:`moe_runtime.prefetch.eam`).

:class:`LookaheadBlend` is the ``eam`` policy's side of it, a base class of
:class:`~moe_runtime.prefetch.eam.EAMPrefetch`: the model hands the scores over
(:meth:`LookaheadBlend.observe_lookahead`) right before the layer's routing, and the plan takes
them (:meth:`LookaheadBlend._plan_rows`).
"""

from __future__ import annotations

import numpy as np

import moe_runtime.prefetch.eam_kernels as eam_kernels
from moe_runtime.errors import ConfigError


class LookaheadBlend:
    """The ``eam`` policy's router lookahead: the scores the model hands over, and their blend
    into the plan's rows. A base class of :class:`~moe_runtime.prefetch.eam.EAMPrefetch`, whose
    attributes (``num_layers``, ``num_experts``, ``depth``, the latest plan ``_last``) it reads."""

    num_layers: int
    num_experts: int
    depth: int

    def _init_lookahead(self, lookahead: int, lookahead_weight: float, depth: int | None) -> None:
        """``lookahead``: the later layers the model computes router scores for (0: none, the
        paper's plan); ``lookahead_weight``: their weight in the blend; ``depth``: the plan depth
        asked for (None: the lookahead's, when it is on).

        Raises:
            ConfigError: a negative lookahead or weight.
        """
        if lookahead < 0:
            raise ConfigError(f"--router-lookahead must be >= 0, got {lookahead}")
        if lookahead_weight < 0:
            raise ConfigError(f"router lookahead weight must be >= 0, got {lookahead_weight}")
        self.lookahead_depth = lookahead  # the model computes router lookahead scores when > 0
        if lookahead > 0 and depth is None:
            self.depth = lookahead  # plan only the layers the lookahead sees (docs/results.md)
        self.lookahead_weight = lookahead_weight
        self._ahead: tuple[int, np.ndarray] | None = None  # (layer, [D, E]) of the current layer
        self._lookahead_s = 0.0  # the router lookahead's host time of the layer about to route
        self._no_ahead = np.zeros((0, self.num_experts), dtype=np.float32)  # a plan without lookahead

    def observe_lookahead(self, layer: int, scores: np.ndarray) -> None:
        """Router lookahead scores ``[D, E]`` of MoE layers ``layer + 1 .. layer + D``, handed over
        by the model right before :meth:`after_routing` of ``layer``."""
        self._ahead = (layer, scores)

    def blend_lookahead(self, layer: int, probs: np.ndarray | None) -> np.ndarray | None:
        """``probs [L, E]`` with the router lookahead of ``layer`` blended into its next layers
        (consumes the lookahead :meth:`observe_lookahead` handed over)."""
        lo = layer + 1
        rows = None if probs is None else probs[lo : min(self.num_layers, lo + self.depth)]
        ahead, self._ahead = self._ahead, None
        out = self._blend_ahead(layer, rows, ahead)
        if out is rows:
            return probs
        full = np.zeros((self.num_layers, self.num_experts), np.float32) if probs is None else probs.copy()
        full[lo : lo + len(out)] = out
        return full

    def _plan_rows(
        self, layer: int, rows: np.ndarray | None, ahead: tuple[int, np.ndarray] | None
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The plan's rows ``[D, E]`` (layers ``layer + 1 ..``; zeros where ``rows`` is None but a
        lookahead is there) and the router lookahead ``[d, E]`` (float32, contiguous) to blend
        into the first ``d`` of them, or None (none for ``layer``, or weight 0): ``rows`` itself
        then. ``ahead``: ``(layer, [D, E] scores)`` as :meth:`observe_lookahead` keeps it, or
        None. The blend itself (``eam_kernels.blend``) runs inside the plan's compiled call."""
        if ahead is None or ahead[0] != layer or self.lookahead_weight == 0:
            return rows, None
        n = min(self.num_layers, layer + 1 + self.depth) - layer - 1  # rows of the plan
        d = min(self.lookahead_depth, n, len(ahead[1]))
        if d <= 0:
            return rows, None
        base = np.zeros((n, self.num_experts), np.float32) if rows is None else rows
        spec = ahead[1]
        if len(spec) != d or spec.dtype != np.float32 or not spec.flags.c_contiguous:
            spec = np.ascontiguousarray(spec[:d], dtype=np.float32)
        return base, spec

    def _blended(self, rows: np.ndarray, spec: np.ndarray | None) -> np.ndarray:
        """``rows [D, E]`` with the lookahead ``spec [d, E]`` of :meth:`_plan_rows` blended in
        (``eam_kernels.blend``; a new array), or ``rows`` itself without one."""
        return rows if spec is None else eam_kernels.blend(rows, spec, self.lookahead_weight)

    def _blend_ahead(
        self, layer: int, rows: np.ndarray | None, ahead: tuple[int, np.ndarray] | None
    ) -> np.ndarray | None:
        """The plan's rows ``rows [D, E]`` (layers ``layer + 1 ..``) with the router lookahead
        ``ahead`` (``(layer, [D, E] scores)``, or None) blended in: ``rows`` itself without a
        lookahead for ``layer``, else a new array."""
        rows, spec = self._plan_rows(layer, rows, ahead)
        return None if rows is None else self._blended(rows, spec)

    @property
    def last_probs(self) -> np.ndarray | None:
        """``[L, E]`` probabilities of the latest plan (rows it covers; others 0), or None."""
        if self._last is None:
            return None
        lo, rows, spec = self._last
        prob = np.zeros((self.num_layers, self.num_experts), np.float32)
        prob[lo : lo + len(rows)] = self._blended(rows, spec)
        return prob

    def note_lookahead_time(self, seconds: float) -> None:
        """The router lookahead of the layer about to route took ``seconds`` of the compute
        thread (``moe_runtime.layers.router_lookahead``); charged to that layer's plan."""
        self._lookahead_s += seconds
