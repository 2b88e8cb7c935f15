"""Cache policies beyond LRU: activation-aware (``eam``), lifetime counts and Belady (``oracle``).

``eam`` follows MoE-Infinity §5.2: prefetched-not-yet-used and in-flight experts are protected by
the buffer itself; after an expert is used, or its prefetch turns out unused, its slot's priority
resets to the running requests' request-EAM count for that expert, boosted for early layers
(prefetching helps them least), so evictions take the experts the current requests use least.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_runtime.buffer.cache_policy import CachePolicy
from moe_runtime.errors import ConfigError


def _needs_recorder(name: str, recorder: Any | None) -> Any:
    """The tracer's recorder a request-EAM policy reads. Raises ConfigError when there is none."""
    if recorder is None:
        raise ConfigError(
            f"--cache-policy {name} needs the request tracer (created automatically by the engine)"
        )
    return recorder


class _ResetPolicy(CachePolicy):
    """A policy whose slot priority is recomputed by ``_reset`` on fill, use and mis-prefetch."""

    def _reset(self, slot: int, key: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        self._reset(slot, key)

    def on_use(self, slot: int, key: int) -> None:
        self._reset(slot, key)

    def on_prefetch_unused(self, slot: int, key: int) -> None:
        self._reset(slot, key)


class EAMCachePolicy(_ResetPolicy):
    """Priority = ``(count + 0.5) * (1 + (L - 1 - layer) / L)`` plus a tiny recency term.

    ``count`` is the running requests' request-EAM count for the expert (tokens routed to it so
    far, prefill and decode, this iteration's routed layers included), read from the tracer's
    recorder after every routed layer. The 0.5 keeps the early-layer boost meaningful for
    experts no running request used yet; the recency term (< 0.01) breaks ties LRU-wise.
    """

    name = "eam"

    def __init__(
        self, num_slots: int, num_experts: int, num_layers: int = 1, recorder: Any | None = None
    ) -> None:
        super().__init__(num_slots, num_experts)
        self.recorder = _needs_recorder(self.name, recorder)
        self.num_layers = num_layers
        self.counts = np.zeros(num_layers * num_experts)
        self.boost = (1.0 + (num_layers - 1 - np.arange(num_layers)) / num_layers).tolist()
        self._seen: tuple[int, list[str], int] | None = None  # recorder epoch, batch, layer summed

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        so_far = self.recorder.query(request_ids, layer)  # [B, L, E]
        seen = self._seen
        if seen is not None and seen[0] == self.recorder.epoch and seen[1] == request_ids and layer > seen[2]:
            # same step and batch: only the rows routed since the last call gained counts
            e, lo = self.num_experts, seen[2] + 1
            self.counts[lo * e : (layer + 1) * e] = so_far[:, lo : layer + 1].sum(axis=0).reshape(-1)
        else:
            self.counts = so_far.sum(axis=0).reshape(-1)
        self._seen = (self.recorder.epoch, list(request_ids), layer)

    def _reset(self, slot: int, key: int) -> None:
        layer = key // self.num_experts
        self.priority[slot] = (float(self.counts[key]) + 0.5) * self.boost[layer] + 1e-9 * self.tick()


class EAMReuseCachePolicy(CachePolicy):
    """Evict the expert whose next use is expected furthest away (Belady with estimated reuse).

    Layers run in a loop, one pass per decode step, so an expert of layer ``j`` seen from the
    running layer ``l`` is next needed after ``d = ((j - l - 1) mod L) + 1`` layer runs if the
    next step's tokens pick it, else a whole pass later for every step they do not. With ``r`` the
    share of the running requests' tokens routed to it so far (their request EAMs, MoE-Infinity
    §4) and ``T`` tokens per step, a step uses it with ``p = 1 - (1 - r)^T``, so its expected
    distance is ``d + L (1 / p - 1)``. LRU evicts the experts of the layers just run, which in this
    loop are needed *last*; this policy keeps the upcoming layers' likely experts instead.

    While :attr:`lru` is True (set by the runtime's ``eam`` prefetch policy while its measured
    trial runs it as on-demand, ``moe_runtime.prefetch.gate.ModeTrial``) it is plain LRU: no
    counts are read, and the least recently filled or used candidate is evicted. It is then
    ``ordered`` (``priority`` is the tick of the last fill or use, as LRU's), so the partition
    takes the victim from its heap as for the ``lru`` policy, the same slot at LRU's cost.
    """

    name = "eam-reuse"

    def __init__(
        self, num_slots: int, num_experts: int, num_layers: int = 1, recorder: Any | None = None
    ) -> None:
        super().__init__(num_slots, num_experts)
        self.recorder = _needs_recorder(self.name, recorder)
        self.num_layers = num_layers
        self.layer = 0
        self._p_use = np.zeros(num_layers * num_experts)
        # for ``p_use``, not used yet: (layer or None for all rows, counts, ids' shape) per routing
        # rows of ``_counts`` changed since ``p_use`` last derived them (None: all), and the
        # routing shape ``(T, k)`` they share; bounded by L, however long no victim is needed
        self._dirty: set[int | None] = set()
        self._shape: tuple[int, ...] = (0, 0)
        self._seen: tuple | None = None  # ((live_changes, ids' shape), layer, batch) of the last routing
        self._counts = np.zeros((num_layers, num_experts))  # the batch's counts so far, [L, E]
        self._slot_key = np.full(num_slots, -1)
        self._recency = np.zeros(num_slots)  # tick of the last fill/use, for ties (LRU-wise)
        # Speed: the victim score ``expected - 1e-9 * recency`` per slot (``_score [S]``, with
        # ``_expected [S]``), kept by the slot hooks and recomputed for all slots at the first
        # victim after ``after_routing`` moved the layer or the counts (``_stale``).
        self._expected = np.zeros(num_slots)
        self._score = np.zeros(num_slots)
        self._stale = True
        self._lru = False

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        """Lowest ``priority`` first only while :attr:`lru`: else the choice moves with the
        running layer and the counts (``after_routing``)."""
        return self._lru

    @property
    def lru(self) -> bool:
        """Plain LRU (the ``eam`` prefetch policy's lean mode)."""
        return self._lru

    @lru.setter
    def lru(self, value: bool) -> None:
        changed = bool(value) != self._lru
        self._lru = bool(value)
        if changed and self.on_order_change is not None:
            self.on_order_change()

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        self.layer = layer
        self._stale = True
        if self._lru:
            return
        if request_ids and topk_ids.size:
            # the batch's counts (a snapshot): ``p_use`` is derived when a victim needs it. When
            # the batch, its tokens per step and the live requests are those of the previous
            # layer's routing and the layers follow in loop order, only row ``layer`` changed
            # since, by this step's choices there (the rows after it still hold the finished
            # steps' counts, as the recorder's do): one bincount of the ids updates it, and only
            # that row is handed on; else the recorder's counts are read whole (``query_sum``).
            rec, seen = self.recorder, self._seen
            live = getattr(rec, "live_changes", None)
            key = (live, topk_ids.shape)
            if (
                live is not None
                and seen is not None
                and seen[0] == key
                and layer == (seen[1] + 1) % self.num_layers
                and seen[2] == request_ids
            ):
                row = self._counts[layer]
                row += np.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
                self._dirty.add(layer)
            else:
                self._counts = rec.query_sum(request_ids, layer).astype(np.float64)  # [L, E]
                self._dirty = {None}
            self._shape = topk_ids.shape
            self._seen = (key, layer, list(request_ids))

    @property
    def p_use(self) -> np.ndarray:
        """``[L * E]`` per-step use probability of each key, from the latest routed layer's counts
        (rows of the layers routed since the last call, or all rows)."""
        if self._dirty:
            E, (T, k) = self.num_experts, self._shape
            dirty, self._dirty = self._dirty, set()
            for layer in [None] if None in dirty else dirty:
                counts = self._counts if layer is None else self._counts[layer]  # [L, E] or [E]
                tokens = counts.sum(axis=-1, keepdims=True)
                share = counts / np.where(tokens > 0, tokens, 1.0)  # counts >= 0: a 0-token row is 0
                share *= k  # share of tokens choosing the expert (each token picks k)
                p = 1.0 - (1.0 - np.minimum(share, 1.0)).reshape(-1) ** T
                if layer is None:
                    self._p_use = p
                else:  # the same T as the other rows': the routings' shapes matched
                    self._p_use[layer * E : (layer + 1) * E] = p
        return self._p_use

    def _expected_of(self, key: int) -> float:
        """Expected layer runs until ``key``'s next use (the formula above, for one key)."""
        L = self.num_layers
        dist = (key // self.num_experts - self.layer - 1) % L + 1
        p = max(float(self._p_use[key]), 1e-3)  # fresh: victim() derived it since the routing
        return dist + L * (1.0 / p - 1.0)

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        self._slot_key[slot] = key
        self.priority[slot] = self._recency[slot] = t = self.tick()
        if not self._stale:
            self._expected[slot] = e = self._expected_of(key)
            self._score[slot] = e - 1e-9 * t

    def on_use(self, slot: int, key: int) -> None:
        self.priority[slot] = self._recency[slot] = t = self.tick()
        if not self._stale:
            self._score[slot] = self._expected[slot] - 1e-9 * t

    def on_prefetch_unused(self, slot: int, key: int) -> None:
        if self._lru:  # as LRU: a mis-prefetch (landed before the switch) counts as a use
            self.on_use(slot, key)

    def victim(self, candidates: np.ndarray) -> int:
        if self._lru:  # a partition takes LRU's victim from its heap instead (``ordered``)
            candidates = np.asarray(candidates)
            return int(candidates[self._recency[candidates].argmin()])
        if self._stale:  # free slots (key -1) get a meaningless score; they are never candidates
            keys, L = self._slot_key, self.num_layers
            dist = (keys // self.num_experts - self.layer - 1) % L + 1
            p = np.maximum(self.p_use[keys], 1e-3)
            self._expected = dist + L * (1.0 / p - 1.0)
            self._score = self._expected - 1e-9 * self._recency
            self._stale = False
        candidates = np.asarray(candidates)
        return int(candidates[self._score[candidates].argmax()])  # ties: LRU, then lowest slot


class ModelCountsCachePolicy(_ResetPolicy):
    """BrainStorm-style: priority = lifetime activation count of the expert over all requests.

    The victim compares the *current* counts (they grow in ``after_routing``), so it is not
    ``ordered``: it scores the candidate array each time. Speed: each slot's score
    ``count + 1e-9 * reset priority`` is kept in ``_score [S]``, set by ``_reset`` and recomputed for
    all slots at the first victim after the counts changed, so a victim is one gather and argmin.
    """

    name = "model-counts"
    ordered = False

    def __init__(self, num_slots: int, num_experts: int, num_layers: int = 1) -> None:
        super().__init__(num_slots, num_experts)
        self.counts = np.zeros(num_layers * num_experts)
        self._slot_key = np.full(num_slots, -1)
        self._reset_prio = np.zeros(num_slots)  # ``priority`` as an array, for the vectorised victim
        self._score = np.zeros(num_slots)  # victim score per slot, valid unless ``_stale``
        self._stale = False

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        e = self.num_experts
        self.counts[layer * e : (layer + 1) * e] += np.bincount(topk_ids.reshape(-1), minlength=e)
        self._stale = True

    def _reset(self, slot: int, key: int) -> None:
        self._slot_key[slot] = key
        count = float(self.counts[key])
        prio = count + 1e-9 * self.tick()
        self.priority[slot] = self._reset_prio[slot] = prio
        if not self._stale:
            self._score[slot] = count + 1e-9 * prio

    def victim(self, candidates: np.ndarray) -> int:
        """Lowest current count (then reset priority, then slot) among ``candidates`` (ascending)."""
        if self._stale:  # free slots (key -1) get a meaningless score; they are never candidates
            np.add(self.counts[self._slot_key], 1e-9 * self._reset_prio, out=self._score)
            self._stale = False
        candidates = np.asarray(candidates)
        return int(candidates[self._score[candidates].argmin()])


class OracleCachePolicy(CachePolicy):
    """Belady: evict the candidate whose next use is furthest in the recorded future.

    An expert the running layer execution needs and has not used yet counts as needed now
    (it may be evictable between routing and the layer's run); once used, its next use is the
    following one.

    Each slot's next use is kept (``_next [S]``, positions; inf = never): computed by the slot hooks
    at fill and use, and recomputed only once the cursor has passed it (checked once per cursor
    position, at the first victim there): a value ``v >= cursor`` stays exact because no use lies
    between the position it was computed at and ``v``. A victim is then one gather and argmax.
    """

    name = "oracle"
    ordered = False

    def __init__(self, num_slots: int, num_experts: int, oracle: Any | None = None) -> None:
        super().__init__(num_slots, num_experts)
        if oracle is None:
            raise ConfigError(
                "--cache-policy oracle needs a recorded access log (see moeserve bench policies)"
            )
        self.oracle = oracle
        self._slot_key: list[int] = [-1] * num_slots
        self._used_at: dict[int, int] = {}  # key -> cursor of its latest use
        self._next = np.full(num_slots, -np.inf)  # next use per slot (position; -inf = unknown)
        self._checked: int | None = None  # cursor at which no ``_next`` was below the cursor

    def _next_use(self, key: int) -> float:
        cur = self.oracle.cursor
        return self.oracle.next_use(key, current=self._used_at.get(key) != cur)

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        self._slot_key[slot] = key
        self._next[slot] = self._next_use(key)

    def on_use(self, slot: int, key: int) -> None:
        self._used_at[key] = self.oracle.cursor
        self._next[slot] = self._next_use(key)

    def victim(self, candidates: np.ndarray) -> int:
        """Candidate (ascending slots) whose next use is furthest; the first among equal ones."""
        nxt = self._next
        cur = self.oracle.cursor
        if self._checked != cur:  # the cursor moved: recompute the next uses it passed
            keys = self._slot_key
            for s in np.flatnonzero(nxt < cur).tolist():
                nxt[s] = self._next_use(keys[s])
            self._checked = cur
        candidates = np.asarray(candidates)
        return int(candidates[nxt[candidates].argmax()])
