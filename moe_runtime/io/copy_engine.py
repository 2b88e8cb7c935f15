"""Host->device copies for one device: a dedicated CUDA copy stream with events, or a memcpy.

CUDA: the I/O thread copies from pinned host memory with ``non_blocking=True`` on its own stream,
records an event and waits on it (in the I/O thread, never the compute thread), so the slot is
complete before it is marked ready. Before overwriting a slot it makes the copy stream wait on the
event the compute stream recorded when it last released that slot, so an evicted expert is never
overwritten while a queued kernel may still read it.
"""

from __future__ import annotations

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

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> None:
        """Copy ``src`` (host) into ``dst`` (a device slot) and return once it has landed."""
        self.wait(self.start(dst, src, after))

    def start(
        self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Begin copying ``src`` (host) into ``dst`` (a device slot) once ``after`` (the event the
        compute stream recorded when it last released the slot) has passed; returns what
        :meth:`wait` takes. Several started copies run back to back on the copy stream. CPU: the
        memcpy is done on return (None)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        """Return once the copy :meth:`start` returned ``done`` for has landed."""
        if done is not None:
            done.synchronize()

    def release_event(self) -> torch.cuda.Event | None:
        """Compute side: mark the point after which a released slot may be overwritten."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev
