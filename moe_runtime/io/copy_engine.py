"""Host->device copies for one device: a dedicated CUDA copy stream with events, or a memcpy.

CUDA: the I/O thread copies from pinned host memory with ``non_blocking=True`` on its own stream,
records an event and waits on it (in the I/O thread, never the compute thread), so the slot is
complete before it is marked ready. Before overwriting a slot it makes the copy stream wait on the
event the compute stream recorded when it last released that slot, so an evicted expert is never
overwritten while a queued kernel may still read it.

Each copy is timed by the I/O thread itself (:meth:`CopyEngine.wait` returns its seconds): on
CUDA, the copy stream's own time between an event recorded after the slot's release event has
passed and the copy's done event (the transfer alone, not the wait for the slot); on the CPU, the
``memcpy``. The prefetch gate takes its link time per copy from these.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class CopyEngine:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def bind_thread(self) -> None:
        """Call once in the I/O thread: one device per I/O thread."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> float:
        """Copy ``src`` (host) into ``dst`` (a device slot); return once it has landed, with the
        copy's seconds (:meth:`wait`)."""
        return self.wait(self.start(dst, src, after))

    def start(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> Any:
        """Begin copying ``src`` (host) into ``dst`` (a device slot) once ``after`` (the event the
        compute stream recorded when it last released the slot) has passed; returns what
        :meth:`wait` takes. Several started copies run back to back on the copy stream. CPU: the
        memcpy is done on return (its seconds)."""
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            begun = torch.cuda.Event(enable_timing=True)  # after the slot's release: the copy alone
            begun.record(self._stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self._stream)
        return begun, done

    def wait(self, started: Any) -> float:
        """Return once the copy :meth:`start` returned ``started`` for has landed: its seconds on
        the copy stream (CUDA events' elapsed time) or of the memcpy (CPU)."""
        if not self.cuda:
            return float(started)
        begun, done = started
        done.synchronize()
        return begun.elapsed_time(done) * 1e-3  # ms -> s

    def release_event(self) -> torch.cuda.Event | None:
        """Compute side: mark the point after which a released slot may be overwritten."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev
