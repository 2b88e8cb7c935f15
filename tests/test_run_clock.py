"""The trial's clock (``moe_runtime.prefetch.run_clock``): wall time less the thread's run delay,
and the ``eam`` policy's trial costing its steps with it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_runtime.prefetch.run_clock import SCHEDSTAT, RunClock


def _now(clock: RunClock) -> float | None:
    """Wall time less the run delay (None without the kernel's figure), as the trial takes it."""
    delay = clock.delay()
    return None if delay is None else clock.wall() - delay


@pytest.mark.skipif(not Path(SCHEDSTAT).exists(), reason="the kernel reports no per-thread schedstat")
def test_a_voluntary_wait_counts_and_the_clock_tracks_wall_time() -> None:
    clock = RunClock()
    t0, w0 = _now(clock), time.perf_counter()
    time.sleep(0.03)  # a wait the thread chose (as for the GIL, a lock or a copy): not run delay
    t1, w1 = _now(clock), time.perf_counter()
    assert t0 is not None and t1 is not None
    assert 0.025 <= t1 - t0 <= w1 - w0 + 1e-3


def test_each_reading_thread_opens_the_file_for_itself(tmp_path: Path) -> None:
    """``/proc/thread-self`` names the opening thread: a reading on another thread reopens."""
    import threading

    stat = tmp_path / "schedstat"
    stat.write_text("1 0 1\n")
    clock = RunClock(str(stat))
    assert _now(clock) is not None
    mine = clock._thread
    seen: list[int | None] = []
    t = threading.Thread(target=lambda: (_now(clock), seen.append(clock._thread)))
    t.start()
    t.join()
    assert seen[0] not in (None, mine)
    assert _now(clock) is not None and clock._thread == mine
    clock.close()
    clock.close()  # idempotent


def test_the_run_delay_is_taken_off(tmp_path: Path) -> None:
    stat = tmp_path / "schedstat"
    stat.write_text("1000 0 1\n")
    clock = RunClock(str(stat))
    a = _now(clock)
    stat.write_text("1000 500000000 2\n")  # half a second spent runnable without a CPU
    b = _now(clock)
    assert a is not None and b is not None
    assert b - a == pytest.approx(-0.5, abs=0.05)


@pytest.mark.parametrize("content", [None, "", "12\n", "a b c\n"])
def test_no_schedstat_gives_none_from_then_on(tmp_path: Path, content: str | None) -> None:
    stat = tmp_path / "schedstat"
    if content is not None:
        stat.write_text(content)
    clock = RunClock(str(stat))
    assert _now(clock) is None and not clock.available
    stat.write_text("1 2 3\n")
    assert _now(clock) is None  # one failed read decides


def _policy(buf):
    from test_policies import FakeEAMC, FakeRecorder

    from moe_runtime.prefetch import make_prefetch_policy

    eye = np.eye(4, 5)
    return make_prefetch_policy(
        "eam", buffer=buf, num_layers=4, num_experts=5, top_k=2, recorder=FakeRecorder(eye),
        eamc=FakeEAMC(np.stack([eye, eye])), lookahead=1, matches=1,
    )  # fmt: skip


def test_the_trial_costs_a_step_from_its_first_routed_layer_on_the_run_clock() -> None:
    """A step's cost: wall time from its first routed layer to its end, less the run delay
    accrued since the last step's end (read once a step)."""
    from test_policies import small_store

    from moe_runtime.buffer import ExpertBuffer

    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        pol = _policy(buf)
        assert pol.trial is not None
        walls = iter([10.0, 10.25, 20.0, 20.5])  # two steps: first routed layer, end
        delays = iter([3.0, 3.125])  # the run delay at each step's end
        pol._run_clock.wall = lambda: next(walls)
        pol._run_clock.delay = lambda: next(delays)
        costs = []
        pol.trial.end_step = lambda cost, decode_only, work=1.0: costs.append(cost) or False
        ids = np.array([[0, 1]])
        for _ in range(2):
            for layer in range(4):
                pol.after_routing(layer, ["a"], ids)
            pol.end_step()
        # the first step has no earlier reading of the run delay; the second's grew by 1/8 s
        assert costs == [pytest.approx(0.25), pytest.approx(0.375)]

        # without the kernel's figure: blocking plus the thread's CPU time, as before
        pol._run_clock.delay = lambda: None
        pol._run_clock.wall = lambda: 0.0
        costs.clear()
        for layer in range(4):
            pol.after_routing(layer, ["a"], ids)
        pol._step_blocking_s = buf.stats.total_blocking_s - 0.5  # half a second blocked
        pol._step_cpu_s = time.thread_time() - 0.125  # and an eighth of CPU time
        pol.end_step()
        assert costs == [pytest.approx(0.625, abs=0.02)]
    finally:
        buf.close()


def test_the_gate_takes_each_copys_host_cost_from_the_io_threads_in_the_runtime() -> None:
    """The runtime's gate charges every candidate the I/O threads' own work per copy
    (``ExpertBuffer.copy_host_seconds``, refreshed at each step's end); 0 before any copy."""
    from test_policies import small_store

    from moe_runtime.buffer import ExpertBuffer

    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        pol = _policy(buf)
        pol.end_step()
        assert pol.gate.copy_host_s == 0.0  # nothing copied yet
        buf.parts[0].note_copy_host(3e-5, 2)  # a round of two copies took 30 us of its own work
        pol.end_step()
        assert pol.gate.copy_host_s == pytest.approx(1.5e-5) == buf.copy_host_seconds
    finally:
        buf.close()
