"""One layer execution's experts, looked up by :meth:`ExpertBuffer.start_layer`, handed out in batches.

Resident experts (already pinned) come first as one batch, then the missing ones in batches of
whatever landed since the last batch (the compute thread waits on the buffer's condition; that
wait is the blocking time). When the caller asks for the next batch, the slots of the previous one
are released to the cache policy. ``close()`` releases whatever was not consumed, whether or not
iteration started, and cancels the demand fetches of experts never consumed. If an I/O thread
died, the waiting compute thread raises :class:`IOThreadError` instead of waiting forever.

Each expert is handed out as an :class:`ExpertHandle`: where it sits and its weights.

With hybrid expert execution (:mod:`moe_runtime.hybrid`) a run also carries ``cpu``, the experts
placed on the CPU (computed beside the batches, never handed out), may time each batch the
caller computes (``timer``, a CPU device) and notes when it was last closed (``timed``, ``ended``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from moe_runtime.stats import ExpertStats

if TYPE_CHECKING:
    from moe_runtime.buffer.partition import Partition


class IOThreadError(RuntimeError):
    """An expert I/O thread died; the experts it was to copy will never land."""


@dataclass(slots=True)
class ExpertHandle:
    """A resident expert ready to run: where it sits (``slot`` of ``part``, for the grouped
    kernels that read the slots at once) and its weights ``gate_up [2I, H]`` and ``down [H, I]``
    (device views; read from the slot when asked, so quantized slots dequantize only experts
    that run)."""

    expert: int
    device: torch.device
    hit: bool
    blocked_s: float
    slot: int
    part: Partition

    @property
    def gate_up(self) -> torch.Tensor:
        return self.part.gate_up[self.slot]

    @property
    def down(self) -> torch.Tensor:
        return self.part.down[self.slot]


def handle(e: int, part: Partition, s: int, hit: bool, blocked_s: float) -> ExpertHandle:
    """The :class:`ExpertHandle` of expert ``e`` in slot ``s`` of ``part``."""
    return ExpertHandle(e, part.device, hit, blocked_s, s, part)


class RunOwner(Protocol):
    """What a :class:`LayerRun` uses of the buffer it runs on
    (:class:`~moe_runtime.buffer.expert_buffer.ExpertBuffer`)."""

    num_experts: int
    stats: ExpertStats
    cond: threading.Condition

    def check_io(self) -> None: ...

    def _landed(self, layer: int, waiting: list[tuple[int, Partition]]) -> list[int]: ...

    def _release_all(self, held: list[tuple[Partition, int]]) -> None: ...

    def _abandon(self, layer: int, waiting: list[tuple[int, Partition]]) -> None: ...


class LayerRun:
    """Args: buf: the buffer; layer: MoE layer; ready: ``[(expert, partition, slot)]`` pinned
    resident experts; waiting: ``[(expert, partition)]`` experts loading or queued."""

    def __init__(
        self,
        buf: RunOwner,
        layer: int,
        ready: list[tuple[int, Partition, int]],
        waiting: list[tuple[int, Partition]],
    ) -> None:
        self.buf, self.layer = buf, layer
        self.ready, self.waiting = ready, waiting
        self._current: list[tuple[Partition, int]] = []  # landed experts being used
        self.cpu: Any = None  # hybrid: the experts computed on the CPU (moe_runtime.hybrid.executor)
        self.timer: Callable[[list[int], float], None] | None = None  # hybrid: (experts, seconds) per batch
        self.timed = False  # hybrid: note when the run was closed
        self.ended = 0.0  # perf_counter of the latest close() (when timed)

    @property
    def resident_first(self) -> bool:
        """Whether the first batch holds resident experts (it needs no wait); only before
        :meth:`batches` started."""
        return bool(self.ready)

    def __iter__(self) -> Iterator[ExpertHandle]:
        """The experts one at a time, in the order of :meth:`batches`."""
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[ExpertHandle]]:
        """Yield the resident experts as one batch (if any), then each group of experts that
        landed while the caller waited or computed, until every needed expert was handed out.
        Finish with a batch before asking for the next: its slots are released then."""
        buf, layer, st = self.buf, self.layer, self.buf.stats
        key0 = layer * buf.num_experts
        try:
            if self.ready:  # still listed while in use: close() releases them
                st.expert_batches[layer] += 1
                t0 = 0.0 if self.timer is None else time.perf_counter()
                yield [handle(e, part, s, True, 0.0) for e, part, s in self.ready]
                if self.timer is not None:
                    self.timer([e for e, _, _ in self.ready], time.perf_counter() - t0)
                ready, self.ready = self.ready, []
                buf._release_all([(part, s) for _, part, s in ready])
            while self.waiting:
                with buf.cond:
                    t0 = time.perf_counter()
                    while not (found := buf._landed(layer, self.waiting)):
                        buf.check_io()
                        buf.cond.wait()
                    blocked = time.perf_counter() - t0
                    landed = [self.waiting[i] for i in found]
                    for i in reversed(found):
                        self.waiting.pop(i)
                    slots = [part.key_slot[key0 + e] for e, part in landed]
                    st.blocking_s[layer] += blocked
                    st.device_blocking_s[landed[0][1].index] += blocked
                    st.expert_batches[layer] += 1
                self._current = [(part, s) for (_, part), s in zip(landed, slots)]
                # the batch's wait is charged to its first expert (the one waited for)
                t0 = 0.0 if self.timer is None else time.perf_counter()
                yield [
                    handle(e, part, s, False, blocked if i == 0 else 0.0)
                    for i, ((e, part), s) in enumerate(zip(landed, slots))
                ]
                if self.timer is not None:
                    self.timer([e for e, _ in landed], time.perf_counter() - t0)
                current, self._current = self._current, []
                buf._release_all(current)
        finally:
            self.close()

    def close(self) -> None:
        """Release every pin still held and cancel demand for experts never consumed (idempotent)."""
        if self.timed:
            self.ended = time.perf_counter()
        buf = self.buf
        held = [(part, s) for _, part, s in self.ready] + self._current
        self.ready, self._current = [], []
        if held:
            buf._release_all(held)
        if self.waiting:
            buf._abandon(self.layer, self.waiting)
            self.waiting = []


class ResidentRun:
    """The layer run of a buffer holding every expert: one batch, nothing to pin or release.

    Args: handles: one :class:`ExpertHandle` per needed expert."""

    cpu = None  # no expert runs on the CPU: every one is resident

    def __init__(self, handles: list[ExpertHandle]) -> None:
        self.handles = handles

    def __iter__(self) -> Iterator[ExpertHandle]:
        return iter(self.handles)

    @property
    def resident_first(self) -> bool:
        """Whether the first batch holds resident experts (it needs no wait)."""
        return bool(self.handles)

    def batches(self) -> Iterator[list[ExpertHandle]]:
        yield self.handles

    def close(self) -> None:
        """Nothing is held."""
