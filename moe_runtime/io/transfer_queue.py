"""Priority queue of expert transfers with cancellation (MoE-Infinity §5.1, "prefetching process").

Demand fetches (an expert needed now and not resident) always come before prefetches; prefetches
are ordered by their priority, higher first, then FIFO (the order they were queued or last
re-prioritised in). Cancelling a queued transfer marks it and drops it lazily when popped, so cancel
is O(1). A prefetch plan re-prioritises the whole queue at once (:meth:`TransferQueue.replan`: one
heap rebuild instead of one push per entry). Not thread-safe: the owning buffer's lock guards it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Transfer:
    """One expert copy request. ``key`` is the flat expert key ``layer * E + expert``; ``seq`` is
    the FIFO tie-break among equal priorities, set by the queue; ``queued_at`` is when it was
    first queued (seconds, ``time.perf_counter`` or simulated time)."""

    key: int
    demand: bool
    priority: float = 0.0
    cancelled: bool = False
    queued_at: float = field(default_factory=time.perf_counter)
    seq: int = 0


class TransferQueue:
    """Heap of ``(0 demand / 1 prefetch, -priority, seq, Transfer)`` plus key -> live transfer."""

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
        t.seq = next(self._seq)
        heapq.heappush(self._heap, (0 if t.demand else 1, -t.priority, t.seq, t))

    def replan(
        self, plan: list[tuple[int, float]], replace: bool, now: float | None = None
    ) -> tuple[int, int]:
        """Apply a prefetch plan ``[(key, priority)]`` (keys not resident) in one pass.

        With ``replace``, queued prefetches whose key is not in ``plan`` are cancelled. A key queued
        as demand is left alone; a queued prefetch whose priority changed is re-prioritised in place
        and goes behind the equal-priority ones (as if re-pushed, in plan order); a new key is queued
        (``queued_at = now`` when given). The heap is then rebuilt once from the live transfers.
        Returns ``(new prefetches, cancelled prefetches)``.
        """
        q = self._queued
        cancelled = 0
        if replace and q:
            wanted = {k for k, _ in plan}
            drop = [k for k, t in q.items() if not t.demand and k not in wanted]
            for k in drop:
                q.pop(k).cancelled = True
            cancelled = len(drop)
        issued = 0
        changed = cancelled > 0
        seq = self._seq
        for key, prio in plan:
            t = q.get(key)
            if t is not None:
                if t.demand or t.priority == prio:
                    continue
                t.priority = prio
                t.seq = next(seq)
            else:
                t = Transfer(key, False, prio) if now is None else Transfer(key, False, prio, queued_at=now)
                t.seq = next(seq)
                q[key] = t
                issued += 1
            changed = True
        if changed:
            heap = [(0 if t.demand else 1, -t.priority, t.seq, t) for t in q.values()]
            heapq.heapify(heap)
            self._heap = heap
        return issued, cancelled

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
