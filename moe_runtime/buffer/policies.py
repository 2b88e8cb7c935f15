"""Cache policies beyond LRU: activation-aware (``eam``), lifetime counts and Belady (``oracle``).

``eam`` follows MoE-Infinity §5.2: prefetched-not-yet-used and in-flight experts are protected by
the buffer itself; after an expert is used, or its prefetch turns out unused, its slot's priority
resets to the running requests' request-EAM count for that expert, boosted for early layers
(prefetching helps them least), so evictions take the experts the current requests use least.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import moe_runtime.buffer.reuse_kernel as reuse_kernel
from moe_runtime.buffer.cache_base import CachePolicy
from moe_runtime.errors import ConfigError

# The ``eam-reuse`` cache's weight of a prompt token's choices against a generated token's (see
# EAMReuseCachePolicy): decode steps repeat the decode phase's routing more than the prompt's.
PREFILL_WEIGHT = 0.05


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

    ``r`` weighs each prompt token's choices ``prefill_weight`` (default :data:`PREFILL_WEIGHT`)
    against a generated token's 1: the prompt is a prior until the requests have decoded a few
    tokens, then their decode-phase routing, which the next decode step repeats more closely,
    dominates. Replayed offline on the bundled model's eval routing (``tools/cache_headroom.py`` at 0058d22,
    ``bench policies``' workload at batch 1, 4 and 16 and 10, 25 and 50% buffers)
    0.05 beat 1 (the plain request EAM) by up to 7 points of hit rate and tied it once (0.39 ->
    0.46 at batch 4 and 25%, where Belady without prefetching reaches 0.61).

    While :attr:`lru` is True (set by the runtime's ``eam`` prefetch policy in its ``lean`` mode,
    on-demand + LRU, an optional arm of its measured trial,
    ``moe_runtime.prefetch.gate.ModeTrial``) it is plain LRU: no counts are read, and the least
    recently filled or used candidate is evicted. It is then ``ordered`` (``priority`` is the tick
    of the last fill or use, as LRU's), so the partition takes the victim from its heap as for the
    ``lru`` policy, the same slot at LRU's cost.

    Speed: the counts' row of a routed layer and its use probabilities are updated in one
    compiled call on the compute thread, and a victim is one compiled loop over the evictable
    slots (``moe_runtime.buffer.reuse_kernel``), which the partition hands its evictable mask
    (:meth:`victim_of`).
    """

    name = "eam-reuse"

    def __init__(
        self,
        num_slots: int,
        num_experts: int,
        num_layers: int = 1,
        recorder: Any | None = None,
        prefill_weight: float = PREFILL_WEIGHT,
    ) -> None:
        super().__init__(num_slots, num_experts)
        self.recorder = _needs_recorder(self.name, recorder)
        if not 0.0 <= prefill_weight <= 1.0:
            raise ConfigError(f"eam-reuse prefill_weight must be in [0, 1], got {prefill_weight}")
        self.prefill_weight = prefill_weight
        self.num_layers = num_layers
        self.layer = 0
        self._p_use = np.zeros(num_layers * num_experts)  # [L * E], see ``p_use``
        # ((live_changes, ids' shape), layer, batch (a copy), the caller's list) of the last routing
        self._seen: tuple | None = None
        self._counts = np.zeros((num_layers, num_experts))  # the batch's counts so far, [L, E]
        # routed layers not yet added to ``_counts``, ``(layer, ids [T, k])`` in routing order: the
        # next victim's compiled call adds them (``reuse_kernel.reuse_victim``'s ``pending_ids``
        # for the last one alone, else ``add_rows_probs`` first), or one call once a pass waits
        self._pending: list[tuple[int, np.ndarray]] = []
        self._slot_key = np.full(num_slots, -1)
        self._recency = np.zeros(num_slots)  # tick of the last fill/use, for ties (LRU-wise)
        self._lru = False
        reuse_kernel.warm()  # the victim is one compiled call (moe_runtime.buffer.reuse_kernel)

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
        if changed:  # LRU routings are not counted: the next one reads the counts whole
            self._seen = None
            self._pending = []
            if self.on_order_change is not None:
                self.on_order_change()

    def after_routing(self, layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
        self.layer = layer
        if self._lru:
            return
        if request_ids and topk_ids.size:
            # the batch's counts (a snapshot) and ``p_use`` from them, derived here on the compute
            # thread (victims are chosen on the I/O thread holding the buffer's lock, which the
            # compute thread then waits on). When the batch, its tokens per step and the live
            # requests are those of the previous layer's routing and the layers follow in loop
            # order, only row ``layer`` changed since, by this step's choices there (the rows
            # after it still hold the finished steps' counts, as the recorder's do): one compiled
            # call adds the ids to that row and derives its probabilities; else the recorder's
            # counts are read whole (``query_sum``) and every row is derived. The one call is
            # deferred to the next victim's (``reuse_victim``'s ``pending_ids``, on the I/O thread),
            # and routed layers no victim followed wait for it too (one call for all, or one per
            # pass of layers, ``_apply_pending``): a lone compiled call cost the compute thread
            # 13-16 us per decode layer with its caches cold after the experts' GEMMs (bundled
            # model, batch 4), against 1 us warm; at a 50% buffer, batch 1, no victim comes for
            # many layers, and one call per layer was 40 us of a 6.5 ms decode step.
            rec, seen, L = self.recorder, self._seen, self.num_layers
            live = getattr(rec, "live_changes", None)
            key = (live, topk_ids.shape)
            T, k = topk_ids.shape
            if (
                live is not None
                and len(request_ids) == T  # a decode step: its tokens count 1 each
                and seen is not None
                and seen[0] == key
                # the next layer: of the same step (the caller passes one list per step), or of
                # the next step with the same batch
                and (
                    (request_ids is seen[3] and layer == seen[1] + 1)
                    or (layer == (seen[1] + 1) % L and seen[2] == request_ids)
                )
            ):
                if topk_ids.dtype != np.int64 or not topk_ids.flags.c_contiguous:
                    topk_ids = np.ascontiguousarray(topk_ids, dtype=np.int64)  # the runtime's already are
                pending = self._pending
                pending.append((layer, topk_ids))  # row ``layer``'s update: in the next victim's call
                if len(pending) >= L:  # a whole pass without a victim: derive it now, one call
                    self._apply_pending()
                if request_ids is seen[3]:
                    self._seen = (key, layer, seen[2], request_ids)
                    return
            else:
                self._pending = []  # the counts are read whole, this layer's choices included
                counts = rec.query_sum(request_ids, layer, prefill_weight=self.prefill_weight)
                self._counts = np.ascontiguousarray(counts, dtype=np.float64)
                reuse_kernel.reuse_probs(self._counts, self._p_use, 0, L, k, T)
            self._seen = (key, layer, list(request_ids), request_ids)

    @property
    def p_use(self) -> np.ndarray:
        """``[L * E]`` per-step use probability of each key (``reuse_kernel.reuse_probs``), from
        the counts of the latest routing while not :attr:`lru`."""
        if self._pending:
            self._apply_pending()
        return self._p_use

    def _apply_pending(self) -> None:
        """Add every routed layer still pending to the counts and derive their rows of
        ``p_use``: one compiled call (``reuse_kernel.add_row_probs``, or ``add_rows_probs``
        for several)."""
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            layer, ids = pending[0]
            reuse_kernel.add_row_probs(self._counts, self._p_use, layer, ids)
        elif pending:
            layers = np.array([layer for layer, _ in pending], dtype=np.int64)
            ids = np.concatenate([ids for _, ids in pending])
            reuse_kernel.add_rows_probs(self._counts, self._p_use, layers, ids)

    def on_fill(self, slot: int, key: int, prefetch: bool) -> None:
        self._slot_key[slot] = key
        self.priority[slot] = self._recency[slot] = self.tick()

    def on_use(self, slot: int, key: int) -> None:
        self.priority[slot] = self._recency[slot] = self.tick()

    def on_prefetch_unused(self, slot: int, key: int) -> None:
        if self._lru:  # as LRU: a mis-prefetch (landed before the switch) counts as a use
            self.on_use(slot, key)

    def victim(self, candidates: np.ndarray) -> int:
        candidates = np.asarray(candidates)
        if self._lru:  # a partition takes LRU's victim from its heap instead (``ordered``)
            return int(candidates[self._recency[candidates].argmin()])
        evictable = np.zeros(len(self._slot_key), dtype=np.bool_)
        evictable[candidates] = True
        return self.victim_of(evictable)

    def victim_of(self, evictable: np.ndarray) -> int:
        """:meth:`victim` given the evictable slots as a ``[S]`` bool mask (the partition's own,
        without building the candidate list): one compiled call (``reuse_kernel``). Ties: LRU,
        then the lowest slot. Not while :attr:`lru`."""
        keys, p, recency, L, E = self._slot_key, self._p_use, self._recency, self.num_layers, self.num_experts
        pending = self._pending
        ids = reuse_kernel.NO_IDS
        if len(pending) == 1 and pending[0][0] == self.layer:  # the usual case: one call
            ids = pending[0][1]
            self._pending = []
        elif pending:
            self._apply_pending()
        return reuse_kernel.reuse_victim(evictable, keys, p, recency, self.layer, L, E, self._counts, ids)


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
