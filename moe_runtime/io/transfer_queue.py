"""Priority queue of expert transfers with cancellation (MoE-Infinity §5.1, "prefetching process").

Demand fetches (an expert needed now and not resident) always come before prefetches; prefetches
are ordered by their priority, higher first, then FIFO. Cancelling a queued transfer marks it and
drops it lazily when popped, so cancel is O(1). Not thread-safe: the owning buffer's lock guards it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Transfer:
    """One expert copy request. ``key`` is the flat expert key ``layer * E + expert``."""

    key: int
    demand: bool
    priority: float = 0.0
    cancelled: bool = False
    queued_at: float = field(default_factory=time.perf_counter)


class TransferQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Transfer]] = []
        self._queued: dict[int, Transfer] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._queued)

    def queued(self, key: int) -> Transfer | None:
        """The live queued transfer for ``key``, if any."""
        return self._queued.get(key)

    def push(self, t: Transfer) -> None:
        """Queue ``t``, replacing (cancelling) a queued transfer of the same key."""
        old = self._queued.get(t.key)
        if old is not None:
            old.cancelled = True
        self._queued[t.key] = t
        heapq.heappush(self._heap, (0 if t.demand else 1, -t.priority, next(self._seq), t))

    def cancel(self, key: int) -> Transfer | None:
        """Cancel the queued transfer of ``key``; returns it, or None if none was queued."""
        t = self._queued.pop(key, None)
        if t is not None:
            t.cancelled = True
        return t

    def pop(self) -> Transfer | None:
        """Highest-priority live transfer, or None when the queue is empty."""
        while self._heap:
            t = heapq.heappop(self._heap)[3]
            if not t.cancelled:
                del self._queued[t.key]
                return t
        return None

    def peek(self) -> Transfer | None:
        while self._heap and self._heap[0][3].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][3] if self._heap else None

    def queued_prefetch_keys(self) -> list[int]:
        return [k for k, t in self._queued.items() if not t.demand]
