"""Priority queue of expert transfers with cancellation (MoE-Infinity §5.1, "prefetching process").

Demand fetches (an expert needed now and not resident) always come before prefetches; prefetches
are ordered by their priority, higher first, then FIFO (the order they were queued or last
re-prioritised in). Not thread-safe: the owning buffer's lock guards it.

NOTE: layout. A prefetch plan re-prioritises the whole queue after every MoE layer, and with
hundreds of candidates (128-expert models, many later layers) per-entry Python work dominated the
simulator. So prefetches live in per-key numpy arrays (queued flag, priority, FIFO sequence number,
queue time) and :meth:`TransferQueue.replan` applies a plan in one compiled (numba) call, with one
sort that fixes the pop order (none when the plan, best first, already is it); pops
walk that order, an index array, skipping keys no longer queued (cancel and pop are O(1)). A single
:meth:`~TransferQueue.push` of a prefetch re-sorts lazily at the next pop. Demands are a FIFO of
:class:`Transfer` objects with lazy cancellation.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moe_runtime.jit import njit


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
    """Demand FIFO plus a prefetch queue kept as per-key arrays (see the module note).

    Args:
        num_keys: flat expert keys the queue expects (``L * E``); it grows if a larger key comes.
    """

    def __init__(self, num_keys: int = 0) -> None:
        self._demand_fifo: deque[Transfer] = deque()
        self._demand: dict[int, Transfer] = {}  # live queued demand per key
        n = max(16, num_keys)
        self._queued = np.zeros(n, dtype=bool)  # key is queued as a prefetch
        self._prio = np.zeros(n)  # its priority (valid while queued)
        self._seq = np.zeros(n, dtype=np.int64)  # its FIFO tie-break
        self._queued_at = np.zeros(n)
        self._is_demand = np.zeros(n, dtype=bool)  # key is queued as a demand (mirrors _demand)
        self._n_prefetch = 0
        self._next_seq = 0
        self._order = np.zeros(0, dtype=np.int64)  # queued prefetch keys in pop order (stale ones skipped)
        self._cursor = 0
        self._order_ok = True
        self._head: Transfer | None = None  # the prefetch peek returned, until the queue changes
        _warm()

    def __len__(self) -> int:
        return len(self._demand) + self._n_prefetch

    def _fit(self, max_key: int) -> None:
        n = self._queued.size
        if max_key < n:
            return
        grow = max(max_key + 1, 2 * n) - n
        self._queued = np.concatenate([self._queued, np.zeros(grow, dtype=bool)])
        self._prio = np.concatenate([self._prio, np.zeros(grow)])
        self._seq = np.concatenate([self._seq, np.zeros(grow, dtype=np.int64)])
        self._queued_at = np.concatenate([self._queued_at, np.zeros(grow)])
        self._is_demand = np.concatenate([self._is_demand, np.zeros(grow, dtype=bool)])

    def _prefetch_transfer(self, key: int) -> Transfer:
        return Transfer(
            key, False, float(self._prio[key]), queued_at=float(self._queued_at[key]), seq=int(self._seq[key])
        )

    def queued(self, key: int) -> Transfer | None:
        """The queued transfer for ``key``, if any (a prefetch comes back as a snapshot)."""
        t = self._demand.get(key)
        if t is not None:
            return t
        if key < self._queued.size and self._queued[key]:
            return self._prefetch_transfer(key)
        return None

    def push(self, t: Transfer) -> None:
        """Queue ``t``, replacing (cancelling) a queued transfer of the same key."""
        self._head = None
        key = t.key
        if key >= self._queued.size:
            self._fit(key)
        elif key in self._demand or self._queued[key]:
            self.cancel(key)
        t.seq = self._next_seq
        self._next_seq += 1
        if t.demand:
            self._demand[key] = t
            self._demand_fifo.append(t)
            self._is_demand[key] = True
            return
        self._queued[key] = True
        self._prio[key], self._seq[key], self._queued_at[key] = t.priority, t.seq, t.queued_at
        self._n_prefetch += 1
        self._order_ok = False

    def replan(
        self, keys: np.ndarray, priorities: np.ndarray, replace: bool, now: float | None = None
    ) -> tuple[int, int]:
        """Apply a prefetch plan: distinct ``keys [n]`` (not resident) with ``priorities [n]``.

        With ``replace``, queued prefetches whose key is not in the plan are cancelled. A key queued
        as demand is left alone; a queued prefetch whose priority changed is re-prioritised and goes
        behind the equal-priority ones (as if re-pushed, in plan order); a new key is queued
        (``queued_at = now``, default ``time.perf_counter()``). Returns ``(new prefetches,
        cancelled prefetches)``. Equivalent to cancelling what fell out and then pushing each
        changed entry in plan order, which is what the tests check. One compiled call
        (:func:`_replan`).
        """
        self._head = None
        keys = np.asarray(keys, dtype=np.int64)
        priorities = np.asarray(priorities, dtype=np.float64)
        if keys.size:
            top = int(keys.max())
            if top >= self._queued.size:  # a key past the key space: grow (rare; sized by the owner)
                self._fit(top)
        issued, cancelled, self._next_seq, self._n_prefetch, resorted, order = _replan(
            self._queued, self._prio, self._seq, self._queued_at, self._is_demand, bool(self._demand),
            keys, priorities, replace, time.perf_counter() if now is None else now, self._next_seq,
            self._n_prefetch,
        )  # fmt: skip
        if resorted:
            self._order, self._cursor, self._order_ok = order, 0, True
        return issued, cancelled

    def replan_best(
        self,
        flat: np.ndarray,
        held: np.ndarray,
        limit: int,
        base: int,
        replace: bool,
        now: float | None = None,
    ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Select and apply a plan in one compiled call: the best ``limit`` positive entries of
        ``flat [n]`` (scores of keys ``base .. base + n - 1``) not ``held [n]``
        (:func:`best_free`), queued as :meth:`replan` queues them, with their scores as
        priorities. Returns ``(keys [m] int64, scores [m], new prefetches, cancelled
        prefetches)``, the keys best first. The same queue as :func:`best_free` then
        :meth:`replan` give (tests check it), without the per-call Python in between: this runs
        once per planning MoE layer, inside its host-time budget."""
        self._head = None
        if base + flat.size > self._queued.size:  # past the key space: grow (rare; sized by the owner)
            self._fit(base + flat.size - 1)
        keys, scores, issued, cancelled, self._next_seq, self._n_prefetch, resorted, order = _replan_best(
            flat, held, limit, base, self._queued, self._prio, self._seq, self._queued_at, self._is_demand,
            bool(self._demand), replace, time.perf_counter() if now is None else now, self._next_seq,
            self._n_prefetch,
        )  # fmt: skip
        if resorted:
            self._order, self._cursor, self._order_ok = order, 0, True
        return keys, scores, issued, cancelled

    def replan_ranked(
        self,
        keys: np.ndarray,
        priorities: np.ndarray,
        held: np.ndarray,
        limit: int,
        replace: bool,
        now: float | None = None,
    ) -> tuple[int, int]:
        """Apply a ranked plan in one compiled call: the first ``limit`` of ``keys [n]`` (int64,
        distinct, best first) that are not ``held [num_keys]``, with ``priorities [n]``
        (float64), queued as :meth:`replan` queues them. Returns ``(new prefetches, cancelled
        prefetches)``. For a policy that ranked its plan itself (``gate_kernels.limit_gate_plan``):
        :meth:`replan_best` without its selection and sort."""
        self._head = None
        if held.size > self._queued.size:  # past the key space: grow (rare; sized by the owner)
            self._fit(held.size - 1)
        issued, cancelled, self._next_seq, self._n_prefetch, resorted, order = _replan_ranked(
            keys, priorities, held, limit, self._queued, self._prio, self._seq, self._queued_at,
            self._is_demand, bool(self._demand), replace, time.perf_counter() if now is None else now,
            self._next_seq, self._n_prefetch,
        )  # fmt: skip
        if resorted:
            self._order, self._cursor, self._order_ok = order, 0, True
        return issued, cancelled

    def _sort(self) -> None:
        """Fix the pop order of the queued prefetches: priority descending, then FIFO."""
        keys = self._queued.nonzero()[0]
        self._order = _pop_order(keys, self._prio[keys], self._seq)
        self._cursor = 0
        self._order_ok = True

    def cancel(self, key: int) -> Transfer | None:
        """Cancel the queued transfer of ``key``; returns it, or None if none was queued."""
        self._head = None
        t = self._demand.pop(key, None)
        if t is not None:
            t.cancelled = True
            self._is_demand[key] = False
            return t
        if key < self._queued.size and self._queued[key]:
            self._queued[key] = False
            self._n_prefetch -= 1
            t = self._prefetch_transfer(key)
            t.cancelled = True
            return t
        return None

    def pop(self) -> Transfer | None:
        """Highest-priority live transfer (demands first), or None when the queue is empty."""
        t = self.peek()
        if t is None:
            return None
        self._head = None
        if t.demand:
            self._demand_fifo.popleft()
            del self._demand[t.key]
            self._is_demand[t.key] = False
        else:
            self._queued[t.key] = False
            self._n_prefetch -= 1
            self._cursor += 1
        return t

    def peek(self) -> Transfer | None:
        fifo = self._demand_fifo
        while fifo and fifo[0].cancelled:
            fifo.popleft()
        if fifo:
            return fifo[0]
        if not self._n_prefetch:
            return None
        if self._head is not None:  # nothing changed since the last peek
            return self._head
        if not self._order_ok:
            self._sort()
        order, queued, c = self._order, self._queued, self._cursor
        while not queued[order[c]]:  # popped or cancelled since the sort
            c += 1
        self._cursor = c
        self._head = self._prefetch_transfer(int(order[c]))
        return self._head

    def queued_prefetch_keys(self) -> list[int]:
        """Keys queued as prefetches (ascending)."""
        return np.flatnonzero(self._queued).tolist()


@njit(cache=True)
def best_free(flat: np.ndarray, held: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``limit`` positive entries of ``flat [n]`` (float32) not ``held [n]``, best first.

    Returns ``(positions [m] int64, values [m] float32)``, ``m <= limit``; equal values keep
    ascending position order (a stable descending sort).
    """
    n = flat.size
    cand = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        if flat[i] > 0 and not held[i]:
            cand[m] = i
            m += 1
    cand = cand[:m]
    neg = np.empty(m, dtype=flat.dtype)
    for j in range(m):
        neg[j] = -flat[cand[j]]
    order = np.argsort(neg, kind="mergesort")[:limit]
    keys = cand[order]
    vals = np.empty(keys.size, dtype=flat.dtype)
    for j in range(keys.size):
        vals[j] = flat[keys[j]]
    return keys, vals


@njit(cache=True)
def _pop_order(keys: np.ndarray, priorities: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """``keys`` by ``priorities`` descending, then FIFO number ``seq[key]`` ascending."""
    fifo = np.empty(keys.size, dtype=np.int64)
    for i in range(keys.size):
        fifo[i] = seq[keys[i]]
    by_fifo = np.argsort(fifo, kind="mergesort")
    neg = np.empty(keys.size)
    for i in range(keys.size):
        neg[i] = -priorities[by_fifo[i]]
    return keys[by_fifo[np.argsort(neg, kind="mergesort")]]


@njit(cache=True)
def _replan(
    queued: np.ndarray,
    prio: np.ndarray,
    seq: np.ndarray,
    queued_at: np.ndarray,
    is_demand: np.ndarray,
    any_demand: bool,
    keys: np.ndarray,
    priorities: np.ndarray,
    replace: bool,
    now: float,
    next_seq: int,
    n_prefetch: int,
) -> tuple[int, int, int, int, bool, np.ndarray]:
    """:meth:`TransferQueue.replan` on the queue's per-key arrays (changed in place; every key
    within them). Returns ``(issued, cancelled, next FIFO number, queued prefetches, resorted,
    pop order)``; the pop order is valid only when ``resorted``.

    A plan already by priority descending whose every entry is re-pushed (so FIFO numbers rise
    along it), as :meth:`PrefetchPolicy.issue` builds them, is the pop order as it stands: no sort.
    """
    if any_demand:  # a key queued as demand is left alone
        m = 0
        kept_keys = np.empty(keys.size, dtype=np.int64)
        kept_prio = np.empty(keys.size)
        for i in range(keys.size):
            if not is_demand[keys[i]]:
                kept_keys[m], kept_prio[m] = keys[i], priorities[i]
                m += 1
        keys, priorities = kept_keys[:m], kept_prio[:m]
    n = keys.size
    n_was = 0
    for i in range(n):
        n_was += queued[keys[i]]
    issued = n - n_was
    cancelled = n_prefetch - n_was if replace else 0  # afterwards exactly ``keys`` are queued
    n_changed = 0
    for i in range(n):  # changed entries are re-pushed in plan order
        k = keys[i]
        if not queued[k]:
            queued_at[k] = now
        elif prio[k] == priorities[i]:
            continue
        seq[k] = next_seq
        next_seq += 1
        prio[k] = priorities[i]
        n_changed += 1
    if cancelled:
        queued[:] = False
    if cancelled or issued:
        for i in range(n):
            queued[keys[i]] = True
    n_prefetch += issued - cancelled
    if not (n_changed or cancelled):
        return issued, cancelled, next_seq, n_prefetch, False, keys
    if not replace:  # other prefetches stay queued: sort them all
        order = np.flatnonzero(queued)
        queued_prio = np.empty(order.size)
        for i in range(order.size):
            queued_prio[i] = prio[order[i]]
        return issued, cancelled, next_seq, n_prefetch, True, _pop_order(order, queued_prio, seq)
    if n_changed == n:  # every entry re-pushed: FIFO numbers follow the plan
        falling = True
        for i in range(1, n):
            if priorities[i] > priorities[i - 1]:
                falling = False
                break
        if falling:
            return issued, cancelled, next_seq, n_prefetch, True, keys.copy()
    return issued, cancelled, next_seq, n_prefetch, True, _pop_order(keys, priorities, seq)


@njit(cache=True)
def _replan_best(
    flat: np.ndarray,
    held: np.ndarray,
    limit: int,
    base: int,
    queued: np.ndarray,
    prio: np.ndarray,
    seq: np.ndarray,
    queued_at: np.ndarray,
    is_demand: np.ndarray,
    any_demand: bool,
    replace: bool,
    now: float,
    next_seq: int,
    n_prefetch: int,
) -> tuple[np.ndarray, np.ndarray, int, int, int, int, bool, np.ndarray]:
    """:meth:`TransferQueue.replan_best`: :func:`best_free` then :func:`_replan` with the chosen
    keys (offset by ``base``) and their scores as float64 priorities. Returns ``(keys, scores,
    *_replan's result)``."""
    keys, scores = best_free(flat, held, limit)
    keys += base
    priorities = np.empty(keys.size)
    for i in range(keys.size):
        priorities[i] = scores[i]
    out = _replan(
        queued, prio, seq, queued_at, is_demand, any_demand, keys, priorities, replace, now, next_seq,
        n_prefetch,
    )  # fmt: skip
    return keys, scores, out[0], out[1], out[2], out[3], out[4], out[5]


@njit(cache=True)
def _replan_ranked(
    keys: np.ndarray,
    priorities: np.ndarray,
    held: np.ndarray,
    limit: int,
    queued: np.ndarray,
    prio: np.ndarray,
    seq: np.ndarray,
    queued_at: np.ndarray,
    is_demand: np.ndarray,
    any_demand: bool,
    replace: bool,
    now: float,
    next_seq: int,
    n_prefetch: int,
) -> tuple[int, int, int, int, bool, np.ndarray]:
    """:meth:`TransferQueue.replan_ranked`: the first ``limit`` of ``keys`` not ``held``, then
    :func:`_replan` with them. Returns :func:`_replan`'s result."""
    m = 0
    free = np.empty(min(keys.size, max(limit, 0)), dtype=np.int64)
    free_prio = np.empty(free.size)
    for i in range(keys.size):
        if m == free.size:
            break
        if not held[keys[i]]:
            free[m], free_prio[m] = keys[i], priorities[i]
            m += 1
    return _replan(
        queued, prio, seq, queued_at, is_demand, any_demand, free[:m], free_prio[:m], replace, now, next_seq,
        n_prefetch,
    )  # fmt: skip


_warm_done = False


def _warm() -> None:
    """Compile (or load from numba's on-disk cache) the queue's kernels once per process, at the
    first queue's creation rather than on the first plan's clock (up to a second)."""
    global _warm_done
    if _warm_done:
        return
    flags, values = np.zeros(2, dtype=bool), np.zeros(2)
    for scores in (values.astype(np.float32), values):  # the eam plan's scores, the baselines'
        best_free(scores, flags, 1)
    for replace in (False, True):
        _replan(flags, values.copy(), np.zeros(2, dtype=np.int64), values.copy(), flags.copy(), False,
                np.array([1, 0]), np.array([0.5, 1.0]), replace, 0.0, 0, 0)  # fmt: skip
        _replan_ranked(np.array([1, 0]), values.copy(), flags.copy(), 1, flags.copy(), values.copy(),
                       np.zeros(2, dtype=np.int64), values.copy(), flags.copy(), False, replace, 0.0, 0,
                       0)  # fmt: skip
        for scores in (values.astype(np.float32), values):  # the eam plan's scores, the baselines'
            _replan_best(scores, flags.copy(), 1, 0, flags.copy(), values.copy(), np.zeros(2, dtype=np.int64),
                         values.copy(), flags.copy(), False, replace, 0.0, 0, 0)  # fmt: skip
    _warm_done = True
