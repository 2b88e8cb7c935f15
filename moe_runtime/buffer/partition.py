"""One device's share of the expert buffer: the slot state machine, and the slot views compute reads.

A slot is FREE, LOADING (a copy is in flight into it) or READY. A READY slot is *protected* while
pinned (the running layer will use or is using it) or while it holds a prefetched expert that was
not used yet (MoE-Infinity §5.2: "being prefetched experts are given maximal cache priorities
until they are used or determined to not use"). Unprotected READY slots are evicted in the cache
policy's order (:class:`~moe_runtime.buffer.slots.SlotTable` keeps them). Weights are read-only,
so eviction only forgets the slot's key.

This class is pure bookkeeping (no locks, no threads, no clocks): the runtime's
:class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer` drives it under its lock with real copies,
and the simulator drives the very same object with simulated time. What spans a buffer's
partitions (a layer's look-up on the experts' home partitions, prefetch plans) is in
:mod:`moe_runtime.buffer.plans`.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moe_runtime.buffer.cache_base import CachePolicy
from moe_runtime.buffer.slots import LOADING, READY, SlotTable
from moe_runtime.io.copy_engine import CopyEngine
from moe_runtime.io.link import LinkModel
from moe_runtime.io.transfer_queue import Transfer, TransferQueue
from moe_runtime.quant.layout import DequantSlots, ExpertLayout
from moe_runtime.stats import ExpertStats

# weight of the past in a partition's running mean of its copies' seconds (``Partition.land``)
COPY_DECAY = 0.9


class Partition(SlotTable):
    """Slots of one device: the per-slot state of :class:`~moe_runtime.buffer.slots.SlotTable`
    (``slot_key``, ``state``, ``pins``, ``prefetched``, ``unused``, ``key_slot``, ``free``) and
    the transitions between the states.

    Attributes:
        slots: ``[S, 3 * I * H]`` device tensor (or, when every expert fits on a single CPU device
            without link emulation, the host store itself: nothing is copied); None in simulation.
            Quantized experts (``layout``): ``[S, nbytes]`` uint8, and the views below are
            :class:`~moe_runtime.quant.layout.DequantSlots` that dequantize what they are indexed
            with to ``compute_dtype``.
        gate_up_all / down_all: ``[S, 2I, H]`` / ``[S, H, I]`` strided views of ``slots``;
            ``gate_up_t`` / ``down_t`` the same transposed (``[S, H, 2I]`` / ``[S, I, H]``), the
            right operand of the grouped expert GEMMs; ``gate_up`` / ``down`` per-slot lists.
        held: ``[L * E]`` bool, True for keys LOADING or READY; the partitions of one buffer share
            it (pass ``held``), so a prefetch plan masks out resident keys in one operation.
    """

    def __init__(
        self,
        index: int,
        num_slots: int,
        num_experts: int,
        expert_nbytes: int,
        policy: CachePolicy,
        stats: ExpertStats,
        device: torch.device | None = None,
        slots: torch.Tensor | None = None,
        hidden: int = 0,
        intermediate: int = 0,
        link: LinkModel | None = None,
        held: np.ndarray | None = None,
        layout: ExpertLayout | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_slots, policy)
        self.index = index
        self.device = device
        self.num_experts = num_experts
        self.expert_nbytes = expert_nbytes
        self.slots = slots
        if slots is not None and layout is not None:
            # quantized slots (uint8 rows): the same interface, each access dequantizes the
            # slots it names to ``compute_dtype`` (moe_runtime.quant.layout.DequantSlots)
            dt = compute_dtype or torch.float32
            self.gate_up = DequantSlots(layout, slots, "gate_up", dt)
            self.down = DequantSlots(layout, slots, "down", dt)
            self.gate_up_t = DequantSlots(layout, slots, "gate_up", dt, transposed=True)
            self.down_t = DequantSlots(layout, slots, "down", dt, transposed=True)
        elif slots is not None:
            # 3-D strided views of the flat slots (an expert stays one contiguous row, one copy);
            # the grouped expert kernels read them transposed, as column-major ``mat_b``.
            gu = 2 * intermediate * hidden
            self.gate_up_all = slots[:, :gu].unflatten(1, (2 * intermediate, hidden))  # [S, 2I, H]
            self.down_all = slots[:, gu:].unflatten(1, (hidden, intermediate))  # [S, H, I]
            self.gate_up_t = self.gate_up_all.transpose(1, 2)  # [S, H, 2I]
            self.down_t = self.down_all.transpose(1, 2)  # [S, I, H]
            self.gate_up = list(self.gate_up_all.unbind(0))  # per slot [2I, H]
            self.down = list(self.down_all.unbind(0))  # per slot [H, I]
        self.release_events: list[torch.cuda.Event | None] = [None] * num_slots
        num_keys = len(stats.lookups) * num_experts
        self.held = held if held is not None else np.zeros(num_keys, dtype=bool)
        self.queue = TransferQueue(num_keys)
        self.stats = stats
        self.link = link
        self.copier = CopyEngine(device) if device is not None else None
        # running mean of this device's copies' seconds, timed by its I/O thread (land); None
        # before the first
        self.copy_s_mean: float | None = None
        # running mean of the I/O thread's CPU seconds per copy outside the copy itself and the
        # link's wait (picking, the victim, landing: Python that holds the GIL); None before the first
        self.copy_host_s_mean: float | None = None
        self._protected: dict[int, set[int]] = {}  # layer -> READY slots with ``prefetched`` set
        self.loading = 0  # LOADING slots: copies allocated and not landed (the link's backlog)

    def has_unused_prefetch(self) -> bool:
        """Some READY slot holds a prefetch its layer has not run with yet."""
        return bool(self._protected)

    def preload(self, keys: list[int]) -> None:
        """Mark ``keys`` resident in slots ``0..len(keys)-1`` (the caller filled the memory)."""
        for s, key in enumerate(keys):
            self.slot_key[s], self.state[s] = key, READY
            self.key_slot[key] = s
            self.held[key] = True
            self.policy.on_fill(s, key, prefetch=False)
            self._refresh(s, True)
        self.free = list(range(self.num_slots - 1, len(keys) - 1, -1))

    def _unprotect(self, s: int, key: int) -> None:
        self.prefetched[s] = False
        layer = key // self.num_experts
        slots = self._protected[layer]
        slots.discard(s)
        if not slots:
            del self._protected[layer]

    # ------------------------------------------------------------------ I/O side
    def allocate(self, t: Transfer) -> int | None:
        """Take a free slot or evict the cache policy's victim for transfer ``t``; None when
        nothing may be taken."""
        if self.free:
            s = self.free.pop()
        else:
            s = self._victim(t.demand)
            if s is None:
                return None
            old = self.slot_key[s]
            self.policy.on_evict(s, old)
            del self.key_slot[old]
            self.held[old] = False
            if self.unused[s]:
                self.stats.prefetch_wasted_bytes += self.expert_nbytes
            if self.prefetched[s]:
                self._unprotect(s, old)
            self.unused[s] = False
        self.slot_key[s], self.state[s] = t.key, LOADING
        self.loading += 1
        self.key_slot[t.key] = s
        self.held[t.key] = True
        if t.demand:
            self.pins[s] += 1  # the waiting compute thread holds it until it has used it
        self._refresh(s, False)
        return s

    def land(self, s: int, t: Transfer, copy_s: float | None = None) -> None:
        """The copy of transfer ``t`` into ``s`` completed, taking ``copy_s`` seconds by the I/O
        thread's own timing (:class:`~moe_runtime.io.copy_engine.CopyEngine`; the emulated link's
        time with one; None: not timed, the simulator)."""
        if copy_s is not None:
            self.stats.copies += 1
            self.stats.copy_s += copy_s
            m = self.copy_s_mean
            # a running mean; a repeated figure (an emulated link's) leaves it exactly as it is
            self.copy_s_mean = copy_s if m is None else m + (1 - COPY_DECAY) * (copy_s - m)
        self.state[s] = READY
        self.loading -= 1
        prefetch = not t.demand
        self.prefetched[s] = self.unused[s] = prefetch
        if prefetch:
            self._protected.setdefault(t.key // self.num_experts, set()).add(s)
            self.stats.prefetch_bytes += self.expert_nbytes
        else:
            self.stats.demand_bytes += self.expert_nbytes
        self.policy.on_fill(s, t.key, prefetch=prefetch)
        self._refresh(s, True)

    def note_copy_host(self, seconds: float, copies: int) -> None:
        """The I/O thread spent ``seconds`` of its own CPU time outside the copies and the
        link's waits on a round of ``copies`` copies (:attr:`copy_host_s_mean`)."""
        per = seconds / copies
        m = self.copy_host_s_mean
        self.copy_host_s_mean = per if m is None else m + (1 - COPY_DECAY) * (per - m)

    # ------------------------------------------------------------------ compute side
    def pin(self, s: int) -> None:
        """The running layer will use the expert in ``s`` (READY or LOADING): keep it."""
        self.pins[s] += 1
        self._refresh(s, False)

    def look_up(self, keys: list[int], layer: int, queued_at: float | None = None) -> list[int | None]:
        """The running layer needs ``keys`` (experts of MoE layer ``layer``) homed here, in order.

        Counts the lookups in the stats. Per key: resident: pins it and gives its slot (a hit);
        loading: pins it (a late prefetch); queued or absent: queues a demand fetch, which replaces
        a queued prefetch (stamped ``queued_at`` when given, for simulated time). Both give None:
        the caller waits for the slot to turn READY. One call per layer keeps the per-lookup
        cost down (the stats are added once).
        """
        key_slot, state, pins, unused, refresh = (
            self.key_slot,
            self.state,
            self.pins,
            self.unused,
            self._refresh,
        )
        out: list[int | None] = []
        hits = hits_prefetched = late = demand = 0
        for key in keys:
            s = key_slot.get(key)
            if s is None:
                at = time.perf_counter() if queued_at is None else queued_at
                self.queue.push(Transfer(key, True, queued_at=at))
                demand += 1
                out.append(None)
                continue
            pins[s] += 1  # as pin(): the running layer keeps it
            refresh(s, False)
            if state[s] == READY:
                hits += 1
                hits_prefetched += unused[s]
                out.append(s)
            else:  # its prefetch is in flight
                late += 1
                out.append(None)
        st, d = self.stats, self.index
        st.lookups[layer] += len(keys)
        st.device_lookups[d] += len(keys)
        st.hits[layer] += hits
        st.device_hits[d] += hits
        st.hits_prefetched[layer] += hits_prefetched
        st.late_prefetches[layer] += late
        st.demand_fetches[layer] += demand
        return out

    def unpin(self, s: int) -> None:
        """Drop a pin without using the expert (an abandoned layer)."""
        self.pins[s] -= 1
        self._refresh(s, False)

    def release(self, s: int) -> None:
        """The compute thread finished using the expert in ``s``."""
        self.pins[s] -= 1
        if self.unused[s]:
            self.stats.prefetch_used += 1
            self.unused[s] = False
        key = self.slot_key[s]
        if self.prefetched[s]:
            self._unprotect(s, key)
        self.policy.on_use(s, key)
        self._refresh(s, True)

    def settle_prefetches(self, layer: int, needed: set[int]) -> None:
        """Layer ``layer`` is about to run: its prefetched experts it does not need turned out
        unused this time; they lose their protection and the policy resets their priority
        (in ascending slot order)."""
        slots = self._protected.get(layer)
        if not slots:
            return
        for s in sorted(slots):
            key = self.slot_key[s]
            if key not in needed:
                self._unprotect(s, key)
                self.policy.on_prefetch_unused(s, key)
                self._refresh(s, True)
