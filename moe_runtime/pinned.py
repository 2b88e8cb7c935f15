"""Page-locked host memory of exactly the size asked for, for the expert store.

Copies to a GPU are asynchronous DMA only from page-locked ("pinned") host memory (MoE-Infinity
§5.3), so the store that holds every expert is pinned. ``torch.empty(..., pin_memory=True)``
takes its memory from PyTorch's pinned-memory cache, which rounds each allocation up to the next
power of two to reuse blocks: a 58 GB store (Qwen3-30B-A3B's experts in bf16) would lock 64 GB,
Mixtral-8x7B's 87 GB would lock 128 GB, which a host sized for the model does not have.

:func:`pinned_empty` allocates ordinary host memory and page-locks exactly its bytes with
``cudaHostRegister`` (portable: every device's context sees it pinned, for stores split over
several GPUs), as PyTorch's own checkpoint stager does; the memory is unregistered when the tensor
is collected. ``Tensor.is_pinned()`` is true for it and non-blocking copies from it are DMA.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

#: ``cudaHostRegisterPortable``: the registration holds in every CUDA context of the process
HOST_REGISTER_PORTABLE = 1


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``shape`` and ``dtype``, its bytes page-locked exactly.

    Raises:
        RuntimeError: the driver refused to lock the memory (``cudaError`` named), or the host
            allocation failed.
    """
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.untyped_storage().nbytes()
    if nbytes == 0:
        return t
    ptr = t.data_ptr()
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {err})")
    done = weakref.finalize(t, _unregister, cudart, ptr)
    done.atexit = False  # at exit the process's memory goes anyway, maybe after the CUDA context
    return t


def _unregister(cudart, ptr: int) -> None:
    """Unlock ``ptr``'s pages before the allocator frees them (errors ignored: a dying context)."""
    with contextlib.suppress(Exception):
        cudart.cudaHostUnregister(ptr)
