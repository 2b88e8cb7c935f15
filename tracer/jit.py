"""``njit``: numba's compiler where numba is installed, else the function as written.

numba is a dependency (``pyproject.toml``), but a machine that installs the package without its
dependencies (a GPU machine where only a minimal set of wheels is carried: numba's llvmlite alone
is larger than the rest) still imports and runs everything: the kernels are plain
numpy-and-loops Python that numba compiles, and run as that Python, with the same results
(``tests/test_prefetch_kernels.py`` and ``tests/test_tracer_recorder_kernel.py`` check both),
only slower. ``moe_runtime.jit`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from numba import njit
except ImportError:  # pragma: no cover - exercised where numba is missing

    def njit(*args: Any, **_: Any) -> Any:  # noqa: D103 - numba's signature: @njit or @njit(...)
        if len(args) == 1 and callable(args[0]):
            return args[0]

        def keep(fn: Callable[..., Any]) -> Callable[..., Any]:
            return fn

        return keep


__all__ = ["njit"]
