"""One layer execution's experts, looked up by :meth:`ExpertBuffer.start_layer`, handed out in order.

Resident experts (already pinned) come first, then missing ones as each lands (the compute thread
waits on the buffer's condition; that wait is the blocking time). After the caller has used a
handle and asks for the next one, the slot is released to the cache policy. ``close()`` releases
whatever was not consumed, whether or not iteration started, and cancels the demand fetches of
experts never consumed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_runtime.buffer.expert_buffer import ExpertBuffer, ExpertHandle
    from moe_runtime.buffer.partition import Partition


class LayerRun:
    """Args: buf: the buffer; layer: MoE layer; ready: ``[(expert, partition, slot)]`` pinned
    resident experts; waiting: ``[(expert, partition)]`` experts loading or queued."""

    def __init__(
        self,
        buf: ExpertBuffer,
        layer: int,
        ready: list[tuple[int, Partition, int]],
        waiting: list[tuple[int, Partition]],
    ) -> None:
        self.buf, self.layer = buf, layer
        self.ready, self.waiting = ready, waiting
        self._current: tuple[Partition, int] | None = None  # the landed expert being used

    def __iter__(self) -> Iterator[ExpertHandle]:
        from moe_runtime.buffer.expert_buffer import ExpertHandle

        buf, layer, st = self.buf, self.layer, self.buf.stats
        key0 = layer * buf.num_experts
        try:
            while self.ready:
                e, part, s = self.ready[0]  # still listed while in use: close() releases it
                yield ExpertHandle(e, part.device, part.gate_up[s], part.down[s], True, 0.0)
                self.ready.pop(0)
                buf._release(part, s)
            while self.waiting:
                with buf.cond:
                    t0 = time.perf_counter()
                    while (found := buf._first_landed(layer, self.waiting)) is None:
                        buf.cond.wait()
                    blocked = time.perf_counter() - t0
                    e, part = self.waiting.pop(found)
                    s = part.key_slot[key0 + e]
                    st.blocking_s[layer] += blocked
                    st.device_blocking_s[part.index] += blocked
                self._current = (part, s)
                yield ExpertHandle(e, part.device, part.gate_up[s], part.down[s], False, blocked)
                self._current = None
                buf._release(part, s)
        finally:
            self.close()

    def close(self) -> None:
        """Release every pin still held and cancel demand for experts never consumed (idempotent)."""
        buf = self.buf
        for _, part, s in self.ready:
            buf._release(part, s)
        self.ready = []
        if self._current is not None:
            buf._release(*self._current)
            self._current = None
        if self.waiting:
            buf._abandon(self.layer, self.waiting)
            self.waiting = []
