"""Device strings -> ``torch.device``, normalised once.

``cuda`` means the *current* CUDA device (``torch.cuda.current_device()``) everywhere: the dense
weights, the expert slots, the I/O threads (``torch.cuda.set_device`` needs an index, and a
thread's current device is not the caller's), the KV cache and the server. ``cpu`` stays ``cpu``.
Call :func:`normalize_device` where a user's device string enters the runtime; everything
downstream receives an indexed ``torch.device``. Calls that take the *calling thread's* current
device instead of a tensor's (streams, events, graph capture, ``synchronize``) run inside
:func:`device_scope` of the engine's device.
"""

from __future__ import annotations

import contextlib

import torch

from moe_runtime.errors import ConfigError


def normalize_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` with an index for CUDA.

    ``"cpu"`` -> ``cpu``; ``"cuda"`` -> ``cuda:<current device>``; ``"cuda:1"`` -> ``cuda:1``.

    Raises:
        ConfigError: not a device string, a device type other than cpu/cuda, CUDA asked for but
            not available, or a CUDA index beyond the devices present.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"--device {device!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ConfigError(f"--device {device!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r}: CUDA is not available on this machine")
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise ConfigError(f"--device {device!r}: this machine has {count} CUDA device(s)")
    return dev


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` as the calling thread's current CUDA device for a block (``torch.cuda.device``),
    so that streams, events, graph captures and ``synchronize()`` without a device argument are
    the engine's; a no-op for the CPU. Each thread has its own current device, and a new thread
    (the server's engine thread) starts at device 0, so an engine on ``cuda:1`` enters this
    around every step."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
