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
    """Demands: heap ``(seq, Transfer)`` (FIFO); prefetches: heap ``(-priority, seq, Transfer)``.

    ``_demand`` / ``_prefetch`` map each key to its live queued transfer (a key is in at most one).
    Heap entries of cancelled or re-prioritised transfers are dropped lazily (cancelled) or by the
    rebuild in :meth:`replan`.
    """

    def __init__(self) -> None:
        self._demand_heap: list[tuple[int, Transfer]] = []
        self._prefetch_heap: list[tuple[float, int, Transfer]] = []
        self._demand: dict[int, Transfer] = {}
        self._prefetch: dict[int, Transfer] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._demand) + len(self._prefetch)

    def queued(self, key: int) -> Transfer | None:
        """The live queued transfer for ``key``, if any."""
        t = self._prefetch.get(key)
        return t if t is not None else self._demand.get(key)

    def push(self, t: Transfer) -> None:
        """Queue ``t``, replacing (cancelling) a queued transfer of the same key."""
        old = self._prefetch.pop(t.key, None) or self._demand.pop(t.key, None)
        if old is not None:
            old.cancelled = True
        t.seq = next(self._seq)
        if t.demand:
            self._demand[t.key] = t
            heapq.heappush(self._demand_heap, (t.seq, t))
        else:
            self._prefetch[t.key] = t
            heapq.heappush(self._prefetch_heap, (-t.priority, t.seq, t))

    def replan(
        self, plan: list[tuple[int, float]], replace: bool, now: float | None = None
    ) -> tuple[int, int]:
        """Apply a prefetch plan ``[(key, priority)]`` (keys not resident) in one pass.

        With ``replace``, queued prefetches whose key is not in ``plan`` are cancelled. A key queued
        as demand is left alone; a queued prefetch whose priority changed is re-prioritised in place
        and goes behind the equal-priority ones (as if re-pushed, in plan order); a new key is queued
        (``queued_at = now`` when given). The prefetch heap is then rebuilt once. Returns
        ``(new prefetches, cancelled prefetches)``. Equivalent to cancelling what fell out and then
        pushing each changed entry in plan order, which is what the tests check.
        """
        pre = self._prefetch
        cancelled = 0
        if replace and pre:
            drop = pre.keys() - {k for k, _ in plan}
            for k in drop:
                pre.pop(k).cancelled = True
            cancelled = len(drop)
        if self._demand:
            demand = self._demand
            plan = [e for e in plan if e[0] not in demand]
        issued = 0
        changed = cancelled > 0
        seq, get = self._seq, pre.get
        for key, prio in plan:
            t = get(key)
            if t is None:
                t = Transfer(key, False, prio) if now is None else Transfer(key, False, prio, queued_at=now)
                pre[key] = t
                issued += 1
            elif t.priority == prio:
                continue
            else:
                t.priority = prio
            t.seq = next(seq)
            changed = True
        if changed:
            heap = [(-t.priority, t.seq, t) for t in pre.values()]
            heapq.heapify(heap)
            self._prefetch_heap = heap
        return issued, cancelled

    def cancel(self, key: int) -> Transfer | None:
        """Cancel the queued transfer of ``key``; returns it, or None if none was queued."""
        t = self._prefetch.pop(key, None) or self._demand.pop(key, None)
        if t is not None:
            t.cancelled = True
        return t

    def pop(self) -> Transfer | None:
        """Highest-priority live transfer (demands first), or None when the queue is empty."""
        t = self.peek()
        if t is None:
            return None
        if t.demand:
            heapq.heappop(self._demand_heap)
            del self._demand[t.key]
        else:
            heapq.heappop(self._prefetch_heap)
            del self._prefetch[t.key]
        return t

    def peek(self) -> Transfer | None:
        heap = self._demand_heap
        while heap and heap[0][1].cancelled:
            heapq.heappop(heap)
        if heap:
            return heap[0][1]
        heap = self._prefetch_heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def queued_prefetch_keys(self) -> list[int]:
        return list(self._prefetch)
