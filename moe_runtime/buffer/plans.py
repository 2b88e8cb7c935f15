"""What spans the partitions of one buffer: a layer's look-up on its experts' home partitions, the
prefetch capacity, and prefetch plans queued on each expert's home partition (MoE-Infinity §5.1).

The runtime's :class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer` calls these under its lock;
the simulator calls them on its own partitions.
"""

from __future__ import annotations

import numpy as np

from moe_runtime.buffer.partition import Partition
from moe_runtime.io.transfer_queue import best_free
from moe_runtime.stats import ExpertStats


def look_up_layer(
    parts: list[Partition],
    home: list[int],
    keys: list[int],
    layer: int,
    queued_at: float | None = None,
) -> list[tuple[Partition, int | None]]:
    """:meth:`Partition.look_up` of a layer's ``keys`` on their home partitions (``home [L * E]``
    device per key); ``(partition, slot or None)`` per key, in the order of ``keys``."""
    if len(parts) == 1:
        part = parts[0]
        return [(part, s) for s in part.look_up(keys, layer, queued_at)]
    owner = [home[k] for k in keys]
    out: list[tuple[Partition, int | None]] = [(parts[d], None) for d in owner]
    for d, part in enumerate(parts):
        idx = [i for i, o in enumerate(owner) if o == d]
        if idx:
            for i, s in zip(idx, part.look_up([keys[i] for i in idx], layer, queued_at)):
                out[i] = (part, s)
    return out


def prefetch_capacity(parts: list[Partition]) -> int:
    """Slots prefetches could fill now over ``parts`` (free plus evictable; caller holds the
    buffer's lock). Read at every planning layer: one device without a generator."""
    if len(parts) == 1:
        return parts[0].capacity_for_prefetch()
    return sum(p.capacity_for_prefetch() for p in parts)


def apply_prefetch_plan(
    parts: list[Partition],
    home: np.ndarray,
    keys: np.ndarray,
    priorities: np.ndarray,
    replace: bool,
    stats: ExpertStats,
    now: float | None = None,
) -> int:
    """Queue prefetches of distinct flat ``keys [n]`` with ``priorities [n]`` on each expert's home
    partition (MoE-Infinity §5.1).

    With ``replace``, queued prefetches not in the plan are cancelled (in-flight copies finish).
    Keys resident or loading are skipped; a queued transfer is re-prioritised only when its priority
    changed (a queued demand is never downgraded). ``home`` is ``[L * E]`` device per key; ``now``
    stamps new transfers (simulated time). Each partition's queue is re-planned in one bulk call
    (:meth:`TransferQueue.replan`). Returns the prefetches queued or cancelled (0: the I/O threads
    have nothing new to do).
    """
    keys = np.asarray(keys, dtype=np.int64)
    priorities = np.asarray(priorities, dtype=np.float64)
    if len(parts) == 1:
        groups = [(keys, priorities)]
    else:
        dev = home[keys]
        groups = [(keys[dev == i], priorities[dev == i]) for i in range(len(parts))]
    changed = 0
    for part, (k, p) in zip(parts, groups):
        if not k.size and not (replace and len(part.queue)):
            continue
        held = part.held[k]
        if np.count_nonzero(held):  # rare on the policies' path: ``issue`` skipped them already
            free = ~held
            k, p = k[free], p[free]
        issued, cancelled = part.queue.replan(k, p, replace, now)
        stats.prefetch_issued += issued
        stats.prefetch_cancelled += cancelled
        changed += issued + cancelled
    return changed


def apply_best_plan(
    parts: list[Partition],
    home: np.ndarray,
    held: np.ndarray,
    flat: np.ndarray,
    base: int,
    limit: int,
    stats: ExpertStats,
    now: float | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Queue the best ``limit`` positive entries of ``flat [n]`` (scores of flat keys ``base ..
    base + n - 1``) whose key is not ``held [L * E]`` (resident or loading anywhere) as the
    plan of :func:`apply_prefetch_plan` with ``replace`` (MoE-Infinity §5.1). One partition
    selects and re-plans in one compiled call (:meth:`TransferQueue.replan_best`); several select
    first (``best_free``) and re-plan per device. Returns ``(keys [m] best first, scores [m],
    changed)``: ``changed`` as :func:`apply_prefetch_plan` returns it."""
    window = held[base : base + flat.size]
    if len(parts) > 1:
        keys, scores = best_free(flat, window, limit)
        keys += base
        return keys, scores, apply_prefetch_plan(parts, home, keys, scores, True, stats, now)
    keys, scores, issued, cancelled = parts[0].queue.replan_best(flat, window, limit, base, True, now)
    stats.prefetch_issued += issued
    stats.prefetch_cancelled += cancelled
    return keys, scores, issued + cancelled


def apply_ranked_plan(
    parts: list[Partition],
    home: np.ndarray,
    held: np.ndarray,
    keys: np.ndarray,
    priorities: np.ndarray,
    limit: int,
    stats: ExpertStats,
    now: float | None = None,
) -> int:
    """Queue the first ``limit`` of the ranked plan ``keys [n]`` (int64, distinct, best first)
    whose key is not ``held [L * E]`` (resident or loading anywhere), with ``priorities [n]``
    (float64), as the plan of :func:`apply_prefetch_plan` with ``replace`` (MoE-Infinity §5.1):
    :func:`apply_best_plan` for a plan its policy ranked already. One partition re-plans in one
    compiled call (:meth:`TransferQueue.replan_ranked`); several drop the held keys first and
    re-plan per device. Returns ``changed`` as :func:`apply_prefetch_plan` returns it."""
    if len(parts) > 1:
        free = ~held[keys]
        keys, priorities = keys[free][:limit], priorities[free][:limit]
        return apply_prefetch_plan(parts, home, keys, priorities, True, stats, now)
    issued, cancelled = parts[0].queue.replan_ranked(keys, priorities, held, limit, True, now)
    stats.prefetch_issued += issued
    stats.prefetch_cancelled += cancelled
    return issued + cancelled
