"""``ExpertBuffer.start_layer``: lookups happen at once; ``close()`` undoes whatever was not consumed."""

from __future__ import annotations

import torch

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.store import HostExpertStore


def _buffer(link=None) -> ExpertBuffer:
    store = HostExpertStore(2, 4, 4, 2, torch.float32)
    store.data.normal_()
    return ExpertBuffer(store, [torch.device("cpu")], 3, link=link)


def test_start_layer_pins_hits_and_queues_misses_before_iteration():
    buf = _buffer(link=(1e-7, 0.0))  # copies never finish: misses stay queued or loading
    try:
        part = buf.parts[0]
        part.preload([0, 1])  # layer 0, experts 0 and 1 resident
        run = buf.start_layer(0, [0, 1, 2])
        st = buf.stats
        assert st.lookups[0] == 3 and st.hits[0] == 2 and st.demand_fetches[0] == 1
        assert [part.pins[part.key_slot[k]] for k in (0, 1)] == [1, 1]
        run.close()  # never iterated: pins released, the demand fetch withdrawn
        assert [part.pins[part.key_slot[k]] for k in (0, 1)] == [0, 0]
        assert part.queue.queued(2) is None
        run.close()  # idempotent
    finally:
        buf.close()


def test_handles_come_resident_first_and_close_mid_way_releases_the_rest():
    buf = _buffer()
    try:
        part = buf.parts[0]
        part.preload([1])
        run = buf.start_layer(0, [0, 1, 2])
        it = iter(run)
        first = next(it)
        assert first.expert == 1 and first.hit
        second = next(it)
        assert second.expert in (0, 2) and not second.hit
        run.close()
        assert int(sum(part.pins)) == 0
    finally:
        buf.close()
