"""Expert placement over devices: an expert's home device is a hash of ``(layer, expert)``
(MoE-Infinity §5.3, expert parallelism on one server)."""

from __future__ import annotations

import numpy as np


def home_devices(num_layers: int, num_experts: int, num_devices: int) -> np.ndarray:
    """``[L * E]`` int array: the device index of every flat expert key ``layer * E + expert``.

    A 32-bit integer mix (Knuth's multiplicative hash of the key) spreads each layer's experts
    evenly-in-expectation without aligning consecutive experts to the same device.
    """
    keys = np.arange(num_layers * num_experts, dtype=np.uint64)
    mixed = (keys * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)
    mixed ^= mixed >> np.uint64(16)
    return (mixed % np.uint64(num_devices)).astype(np.int64)
