"""``cuda`` means the current CUDA device, normalised once; the engine works with its device as the
calling thread's current one; a dying I/O thread raises in the compute thread instead of leaving
it waiting forever."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch

import moe_runtime.engine.engine as engine_mod
from moe_runtime.assets import default_model_dir
from moe_runtime.buffer import ExpertBuffer
from moe_runtime.buffer.layer_run import IOThreadError
from moe_runtime.config import RuntimeConfig
from moe_runtime.device import device_scope, normalize_device
from moe_runtime.engine.request import SamplingParams
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


def test_device_scope_makes_the_device_current_on_cuda_only(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def fake_device(dev):
        entered.append(dev)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    with device_scope(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]
    with device_scope(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 1)]


def test_every_step_and_capture_runs_in_the_engine_device_scope(monkeypatch):
    """A thread's current CUDA device is its own (the server's engine thread starts at device 0),
    so each step and the start-up capture enter the engine device's scope."""
    scopes = []

    @contextlib.contextmanager
    def recording(dev):
        scopes.append(dev)
        yield

    monkeypatch.setattr(engine_mod, "device_scope", recording)
    runtime = RuntimeConfig(max_model_len=64, max_batch_size=2)
    with engine_mod.LLMEngine.from_pretrained(default_model_dir(), runtime) as engine:
        built = len(scopes)
        engine.generate([[5, 17, 33]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        steps = engine.num_steps
        engine.capture_graphs()
    assert built == 1 and steps >= 3
    assert scopes == [engine.device] * (1 + steps + 1)


def test_cuda_calls_name_their_stream_or_device():
    """An event recorded or a device synchronised without saying which one uses the calling
    thread's current device, not necessarily the engine's: every such call in the runtime says."""
    root = Path(__file__).resolve().parents[1]
    bare = re.compile(r"\.record\(\)|torch\.cuda\.synchronize\(\)")
    found = [
        f"{path.relative_to(root)}:{i}"
        for pkg in ("moe_runtime", "server", "moeserve")
        for path in sorted((root / pkg).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if bare.search(line.split("#")[0])
    ]
    assert not found, found


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


def test_several_cuda_devices_start_at_the_compute_device(fake_cuda):
    from moe_runtime.memory_plan import engine_devices

    cuda = [torch.device("cuda", i) for i in range(3)]
    assert engine_devices(RuntimeConfig(device="cuda:1", num_devices=2)) == cuda[1:3]
    assert engine_devices(RuntimeConfig(device="cuda", num_devices=3)) == [cuda[2], cuda[0], cuda[1]]
    with pytest.raises(ConfigError, match=r"--num-devices 4: this machine has 3 CUDA device"):
        engine_devices(RuntimeConfig(device="cuda:0", num_devices=4))
