"""The compute thread's clock for the runtime's measured trial of its modes (issue #15): wall
time less the time the thread stood runnable but without a CPU.

NOTE: why this clock. ``gate.ModeTrial`` compares what the ``eam`` policy's arms (prefetching,
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
out the host's preemption. (On the development host the run delay was about 0.02 ms per decode
step: there the clock is nearly wall time.)
"""

from __future__ import annotations

import time

#: Per thread: CPU ns, run-queue wait ns, timeslices (``Documentation/scheduler/sched-stats``).
SCHEDSTAT = "/proc/thread-self/schedstat"


class RunClock:
    """Seconds of the calling thread's own time: ``time.perf_counter()`` less the thread's run
    delay so far (the kernel's per-thread schedstat). Differences of two readings on one thread
    are the wall time between them without the time the thread waited for a CPU.

    Args:
        path: the schedstat file (a test can point it elsewhere).

    :meth:`now` returns None where the kernel does not report it (not Linux, no schedstat, an
    unreadable or malformed file); it then stays None (one failed read decides).
    """

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self.path = path
        self.available = True

    def now(self) -> float | None:
        """The calling thread's wall clock less its run delay, in seconds, or None (see the
        class). One small file read (about 10 us): call it per step, not per layer."""
        if not self.available:
            return None
        try:
            with open(self.path, "rb") as f:
                delay_ns = int(f.read(128).split()[1])
        except (OSError, ValueError, IndexError):
            self.available = False
            return None
        return time.perf_counter() - delay_ns * 1e-9
