"""The host allocator's settings for a serving process: freed buffers stay with the process.

PyTorch's CPU tensors come from ``malloc``. glibc serves a large request (above its mmap threshold,
128 KiB at first, raised as mapped blocks are freed, at most 32 MiB) with a fresh ``mmap`` and
gives it back with ``munmap`` when freed, and it trims the top of the main heap back to the kernel
whenever more than twice that threshold is free there. So a thread of the main arena (the main
thread, which runs the engine in ``moeserve generate`` and the benches) pays a page fault for
every 4 KiB page of every large temporary, every time: a prefill's activations, a quantized
expert dequantized per call, a CPU expert's intermediates. On a 2-core EPYC host a 2,048-token
prefill of the bundled model faulted 20,000 pages (39 ms of kernel time, 322-373 ms in all; 294-298
without), and an int8 Qwen3-30B-A3B expert dequantized on the main thread ran 4x slower than on a
pool thread (7,700 faults a call).

:func:`keep_freed_memory` sets both thresholds once per process with ``mallopt``, so temporaries
up to :data:`MMAP_THRESHOLD` (32 MiB) reuse freed heap memory instead: the process keeps up to
:data:`TRIM_THRESHOLD` of freed memory (its resident size stays near its high-water mark, as a
caching allocator's does). Requests above the threshold (a checkpoint's host store) are still
mapped on their own. Where the user set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``, or
the C library is not glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: requests larger than this are still mapped on their own (and unmapped when freed): glibc's
#: largest on a 64-bit host (a larger value is refused)
MMAP_THRESHOLD = 32 << 20
#: freed memory the main heap keeps at its top before giving any back
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module note), once per process; True where
    they are set (now or by an earlier call), False where nothing was changed."""
    global _done
    if _done is None:
        _done = _set()
    return _done


def _set() -> bool:
    if not sys.platform.startswith("linux") or any(v in os.environ for v in _ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
