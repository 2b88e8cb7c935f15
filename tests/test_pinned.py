"""The expert store is page-locked at exactly its size (``cudaHostRegister``; PyTorch's pinned
cache would round it up to a power of two), unlocked when collected, only for a GPU device; a
refused lock is the loader's one-line memory error. CUDA's runtime is a stand-in here."""

from __future__ import annotations

import gc

import pytest
import torch

from moe_runtime.assets import default_model_dir
from moe_runtime.config import RuntimeConfig
from moe_runtime.errors import InsufficientMemoryError
from moe_runtime.loader import load_checkpoint
from moe_runtime.store import HostExpertStore


class FakeCudart:
    """``torch.cuda.cudart()``'s two calls, recorded; ``error``: what registering returns."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.registered.append((ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_the_store_is_locked_at_its_exact_size_and_unlocked_when_collected(cudart):
    store = HostExpertStore(3, 5, 24, 40, torch.bfloat16, pin_memory=True)  # 86,400 bytes: no power of 2
    ptr, nbytes = store.data.data_ptr(), 3 * 5 * 3 * 24 * 40 * 2
    assert store.data.untyped_storage().nbytes() == nbytes
    assert cudart.registered == [(ptr, nbytes, 1)] and cudart.unregistered == []
    del store
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_an_unpinned_store_touches_no_cuda(cudart):
    HostExpertStore(2, 4, 8, 4, torch.float32)
    assert cudart.registered == []


def test_a_refused_lock_is_the_loaders_memory_error(cudart):
    cudart.error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(
        InsufficientMemoryError, match=r"expert store \(cudaHostRegister of \d+ bytes .*cudaError 2"
    ):
        load_checkpoint(default_model_dir(), RuntimeConfig(pin_memory=True))


def test_a_cpu_device_does_not_pin_even_with_cuda_present(cudart, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loaded = load_checkpoint(default_model_dir(), RuntimeConfig(device="cpu"))
    assert cudart.registered == [] and loaded.store.data.numel() > 0
