"""``cuda`` means the current CUDA device, normalised once; a dying I/O thread raises in
the compute thread instead of leaving it waiting forever."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.buffer.layer_run import IOThreadError
from moe_runtime.config import RuntimeConfig
from moe_runtime.device import normalize_device
from moe_runtime.errors import ConfigError
from moe_runtime.io.copy_engine import CopyEngine
from moe_runtime.store import HostExpertStore


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with 3 devices, the current one being 2 (no GPU touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


def test_plain_cuda_becomes_the_current_device(fake_cuda):
    assert normalize_device("cuda") == torch.device("cuda", 2)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert RuntimeConfig(device="cuda").torch_device == torch.device("cuda", 2)


def test_cpu_stays_cpu():
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device(torch.device("cpu")) == torch.device("cpu")
    assert RuntimeConfig().torch_device.index is None


@pytest.mark.parametrize(
    "bad, said",
    [("gpu0", "is not a device"), ("meta", "only cpu and cuda"), ("cuda:7", "has 3 CUDA device")],
)
def test_bad_devices_are_named(fake_cuda, bad, said):
    with pytest.raises(ConfigError, match=said) as err:
        normalize_device(bad)
    assert repr(bad) in str(err.value)


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        normalize_device("cuda")


def test_io_thread_death_is_raised_in_the_compute_thread(monkeypatch):
    """A copy fails in the I/O thread (as ``set_device(cuda)`` without an index did): the layer run
    waiting for its demand fetches raises instead of hanging, and so does every later layer."""

    def broken_copy(self, dst, src, after):
        raise ValueError("Expected a torch.device with a specified index")

    monkeypatch.setattr(CopyEngine, "start", broken_copy)
    store = HostExpertStore(2, 4, 4, 2, torch.float32)
    buf = ExpertBuffer(store, ["cpu"], 2)
    try:
        run = buf.start_layer(0, [0, 1, 2])  # nothing resident: three demand fetches
        with pytest.raises(IOThreadError, match="device 0 .*specified index"):
            for _ in run.batches():
                pass
        assert int(sum(buf.parts[0].pins)) == 0  # the failed run released what it held
        with pytest.raises(IOThreadError):
            buf.start_layer(1, [0])
    finally:
        buf.close()
