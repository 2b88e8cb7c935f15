"""Link model: emulate a host->device link of given bandwidth so offloading is reproducible on CPU.

Without a GPU a "transfer" is a memcpy, far faster than PCIe relative to CPU expert compute. The
I/O thread therefore holds the link for ``latency + bytes / bandwidth`` per transfer
(deadline-based, so sleep overheads do not accumulate). Every benchmark prints these settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class LinkModel:
    """Args: gbps: bandwidth in GB/s (1e9 bytes/s); latency_us: fixed cost per transfer."""

    gbps: float
    latency_us: float = 0.0
    _free_at: float = 0.0

    def transfer_seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def hold(self, nbytes: int, started: float) -> None:
        """Block the calling I/O thread until a transfer begun at ``started`` would finish."""
        start = max(started, self._free_at)
        end = start + self.transfer_seconds(nbytes)
        self._free_at = end
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
