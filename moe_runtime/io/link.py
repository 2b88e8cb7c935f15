"""Link model: emulate a host->device link of given bandwidth so offloading is reproducible on CPU.

Without a GPU a "transfer" is a memcpy, far faster than PCIe relative to CPU expert compute. The
I/O thread therefore holds the link for ``latency + bytes / bandwidth`` per transfer. Every
benchmark prints these settings.

NOTE: deadlines, not durations. ``time.sleep`` returns late: 75-100 us past a 100-1000 us deadline
on the development VM, half of one 96 KiB expert's 197 us at 0.5 GB/s. Each transfer therefore
starts at its deadline-based start (when the link frees, or when the transfer was ready, whichever
is later), not at the moment the I/O thread gets round to it: when the I/O thread goes from one
landed copy straight to the next queued one, the next starts at the previous one's deadline, so
the late wake-up is not charged again per copy and a queue of copies moves at the nominal
bandwidth. Before this (the caller passed only the time it started), every back-to-back copy paid
the overshoot once more and the emulated 0.5 GB/s link moved about 0.35 GB/s. The I/O thread's
wake-up after an idle wait, and the last copy's late return to a compute thread waiting on it,
are still paid, as on a real device (its I/O thread also wakes up and hands the slot back).
Linux lets a thread's sleeps wake up later by its "timer slack", 50 us by default, so the I/O
thread sets its own to 1 us (:meth:`LinkModel.bind_thread`): a 20-200 us sleep then returned
33-46 us late (median) instead of 76-86 us on the development VM.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass

_PR_SET_TIMERSLACK = 29  # prctl(2)
TIMER_SLACK_NS = 1000


@dataclass(slots=True)
class LinkModel:
    """Args: gbps: bandwidth in GB/s (1e9 bytes/s); latency_us: fixed cost per transfer."""

    gbps: float
    latency_us: float = 0.0
    _free_at: float = 0.0
    idle_s: float = 0.0  # link time between one transfer's end and the next one's start

    @staticmethod
    def bind_thread() -> bool:
        """Call once in the I/O thread that holds this link: on Linux, set the calling thread's
        timer slack to :data:`TIMER_SLACK_NS` so its sleeps end closer to their deadlines (see the
        module note). Returns whether it was set (False elsewhere, or if ``prctl`` failed)."""
        if not sys.platform.startswith("linux"):
            return False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            return libc.prctl(_PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) == 0
        except (OSError, AttributeError):
            return False

    def transfer_seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def hold(self, nbytes: int, started: float, ready_at: float | None = None) -> None:
        """Block the calling I/O thread until a transfer of ``nbytes`` would finish.

        Args:
            started: ``time.perf_counter()`` when the I/O thread began the copy.
            ready_at: when the transfer could have begun (queued, slot free, I/O thread not
                waiting), if before ``started``; default ``started``. The link starts it at the
                later of that and the previous transfer's end (see the module note).
        """
        start = max(started if ready_at is None else min(ready_at, started), self._free_at)
        if self._free_at:
            self.idle_s += start - self._free_at
        end = start + self.transfer_seconds(nbytes)
        self._free_at = end
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
