"""``njit`` for the runtime's kernels: :mod:`tracer.jit`'s (numba's compiler where numba is
installed, else the function as written). It lives in ``tracer``, the lowest package, so the
tracer's own kernels can use it too (dependencies point ``tracer`` <- ``moe_runtime``)."""

from __future__ import annotations

from tracer.jit import njit

__all__ = ["njit"]
