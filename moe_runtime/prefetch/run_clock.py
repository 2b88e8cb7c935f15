"""The compute thread's clock for the runtime's measured trial of its modes (ours): wall time
less the time the thread stood runnable but without a CPU.

NOTE: why this clock. ``trial.ModeTrial`` compares what the ``eam`` policy's arms (prefetching,
caching alone) cost a decode step. Measured as the thread's CPU time plus its blocking on expert
copies, it missed the waits an arm causes without blocking: each copy the I/O thread starts and
lands runs Python that holds the GIL, and while copies overlap the compute thread's work (which
is what prefetching is for) the compute thread waits for the GIL. Measured on the bundled model
(10% buffer, 0.5 GB/s, batch 4, prefetching pinned on): 50 us more of GIL-held work per landed
copy added about 6 ms per decode step to wall time less CPU and blocking, and that remainder was
1-3 ms per step with prefetching against about 0 with caching alone, where the compute thread
blocks while the copies run. Wall time holds those waits, but also the host's preemption (other
processes on the CPU), which no arm causes. Linux counts the latter per thread
(``/proc/thread-self/schedstat``, the run delay: time spent runnable on a run queue), so wall
time less the run delay keeps the waits an arm causes (GIL, locks, copies, the link) and leaves
out the host's preemption. (On a 2-core host with nothing else running the run delay was about
0.02 ms per decode step: there the clock is nearly wall time.)
"""

from __future__ import annotations

import os
import threading
import time
import weakref

#: Per thread: CPU ns, run-queue wait ns, timeslices (``Documentation/scheduler/sched-stats``).
SCHEDSTAT = "/proc/thread-self/schedstat"


class RunClock:
    """The calling thread's run delay so far (the kernel's per-thread schedstat), :meth:`delay`,
    and wall time, :meth:`wall`: wall time less the run delay, differenced between two points
    on one thread, is the wall time between them without the time the thread waited for a CPU.

    Args:
        path: the schedstat file (a test can point it elsewhere).

    :meth:`delay` returns None where the kernel does not report it (not Linux, no schedstat, an
    unreadable or malformed file); it then stays None (one failed read decides). The file is
    opened once per reading thread and re-read in place (``os.pread``, about 1 us warm; opening
    it per reading cost 10-30 us); ``/proc/thread-self`` names the thread that opened it, so
    another thread's first reading opens it afresh.

    A reading is still dear in a run: about 30 us of wall time per ``pread`` on the compute thread
    between decode steps (bundled model, batch 4, the I/O thread copying; 0.7 us for
    ``perf_counter``). So the ``eam`` policy reads the wall clock (:meth:`wall`) at a step's
    first routed layer and the run delay (:meth:`delay`) once per step, at its end, taking off
    the delay accrued since the previous step's end.
    """

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self.path = path
        self.available = True
        self._fd: int | None = None
        self._thread: int | None = None
        self._finalizer: weakref.finalize | None = None

    def delay(self) -> float | None:
        """The calling thread's run delay so far (seconds runnable without a CPU), or None (see
        the class). One ``pread``."""
        if not self.available:
            return None
        try:
            if self._thread != threading.get_ident():
                self._open()
            delay_ns = int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            self.available = False
            self.close()
            return None
        return delay_ns * 1e-9

    @staticmethod
    def wall() -> float:
        """Wall time in seconds (``time.perf_counter``), the clock :meth:`delay` is taken off."""
        return time.perf_counter()

    def _open(self) -> None:
        """(Re)open the file for the calling thread."""
        self.close()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._thread = threading.get_ident()
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    def close(self) -> None:
        """Close the file (idempotent; the next reading opens it again)."""
        if self._finalizer is not None:
            self._finalizer()  # closes the fd once
        self._fd = self._thread = self._finalizer = None
