"""The oracle (Belady): replays a recorded expert-access log, so it knows the future.

It is the ideal row of MoE-Infinity's Table 5: perfect prefetching (exactly the experts the next
layers will use, nearest first) and Belady caching (evict the expert whose next use is furthest).
The log comes from an earlier run of the same workload (outputs are identical across policies, so
the access sequence is too): one entry per MoE layer execution, ``(layer, experts)``, in order —
:attr:`ExpertBuffer.access_log` records it. The buffer advances the schedule's cursor once per
routed layer.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from moe_runtime.errors import ConfigError
from moe_runtime.prefetch.base import PrefetchPolicy

NEVER = float("inf")


class OracleSchedule:
    """The future, indexed by position (= the n-th MoE layer execution of the run).

    Args:
        log: ``[(layer, (expert, ...)), ...]`` in execution order.
        num_experts: E, to form flat keys ``layer * E + expert``.
    """

    def __init__(self, log: list[tuple[int, tuple[int, ...]]], num_experts: int) -> None:
        self.log = [(layer, tuple(experts)) for layer, experts in log]
        self.num_experts = num_experts
        self.cursor = -1
        uses: dict[int, list[int]] = {}
        for pos, (layer, experts) in enumerate(self.log):
            for e in experts:
                uses.setdefault(layer * num_experts + e, []).append(pos)
        self._uses = uses
        # The log flattened to entries (one per (position, expert)), for windows over the future:
        # ``_keys [N]`` flat keys, ``_pos [N]`` their positions, ``_start [P + 1]`` each position's
        # first entry, ``_prev [N]`` the entry index of the same key's previous use (-1: none).
        sizes = [len(experts) for _, experts in self.log]
        self._start = np.zeros(len(self.log) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._start[1:])
        self._keys = np.array(
            [layer * num_experts + e for layer, experts in self.log for e in experts], dtype=np.int64
        )
        self._pos = np.repeat(np.arange(len(self.log), dtype=np.int64), sizes)
        order = np.argsort(self._keys, kind="stable")  # by key, then by entry index
        prev = np.full(len(order), -1, dtype=np.int64)
        same = self._keys[order[1:]] == self._keys[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
        self._prev = prev

    def advance(self, layer: int) -> int:
        """Move to the next execution of ``layer``; returns the cursor.

        Raises:
            ConfigError: the run diverged from the recorded log (a different workload).
        """
        self.cursor += 1
        if self.cursor >= len(self.log) or self.log[self.cursor][0] != layer:
            raise ConfigError(
                f"oracle: the run diverged from the recorded access log at position "
                f"{self.cursor} (layer {layer}); replay the same workload"
            )
        return self.cursor

    def next_use(self, key: int, current: bool = False) -> float:
        """Position of ``key``'s next use strictly after the cursor (inf if never); with
        ``current``, a use at the cursor itself counts (the running position still needs it)."""
        uses = self._uses.get(key)
        if not uses:
            return NEVER
        i = (bisect.bisect_left if current else bisect.bisect_right)(uses, self.cursor)
        return uses[i] if i < len(uses) else NEVER

    def upcoming(self, horizon: int, start: int = 1) -> list[tuple[int, int]]:
        """``[(distance, key)]`` for positions ``cursor + start .. cursor + horizon``."""
        out = []
        for d in range(start, horizon + 1):
            pos = self.cursor + d
            if pos >= len(self.log):
                break
            layer, experts = self.log[pos]
            out.extend((d, layer * self.num_experts + e) for e in experts)
        return out

    def first_uses(self, horizon: int, start: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``(distance [n], key [n])``: the entries of :meth:`upcoming` that are each key's first in
        that window (positions ``cursor + start .. cursor + horizon``, clipped to the log), in the
        same order. Vectorised: an entry is its key's first in the window iff the key's previous use
        lies before the window."""
        n = len(self.log)
        lo = min(max(self.cursor + start, 0), n)
        a, b = int(self._start[lo]), int(self._start[min(max(self.cursor + horizon + 1, lo), n)])
        first = self._prev[a:b] < a
        return self._pos[a:b][first] - self.cursor, self._keys[a:b][first]


class OraclePrefetch(PrefetchPolicy):
    """Prefetch exactly what the next ``depth`` layer executions use, nearest first.

    Belady's "do no harm": only experts among each device's ``slots`` soonest-needed ones
    (counting the running position's) are prefetched, so a prefetch never displaces an expert
    that is needed sooner (with the oracle cache policy evicting the furthest next use).
    """

    name = "oracle"

    def __init__(self, *args: Any, oracle: OracleSchedule | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if oracle is None:
            raise ConfigError(
                "--prefetch-policy oracle needs a recorded access log (see moeserve bench policies)"
            )
        self.oracle = oracle

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        scores = np.zeros(self.num_layers * self.num_experts)
        parts = self.buffer.parts
        # Each key's first use in the window, soonest first; per device, only the first
        # ``num_slots`` of them (the soonest-needed experts) may be placed.
        dist, keys = self.oracle.first_uses(self.depth, start=0)
        if len(parts) == 1:
            dist, keys = dist[: parts[0].num_slots], keys[: parts[0].num_slots]
        else:
            devs = np.asarray(self.buffer.home)[keys]
            keep = np.zeros(len(keys), dtype=bool)
            for dev, part in enumerate(parts):
                mine = devs == dev
                keep |= mine & (np.cumsum(mine) <= part.num_slots)
            dist, keys = dist[keep], keys[keep]
        later = dist > 0  # the running position's experts are not prefetched
        scores[keys[later]] = 1.0 - dist[later] / (self.depth + 1)
        self.issue(scores.reshape(self.num_layers, self.num_experts))
