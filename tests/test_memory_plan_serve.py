"""The memory plan end to end: ``moeserve serve`` with only ``--device-memory`` starts on a plan that
fits, prints it and serves; the overrides reach the engine; a dense part that does not fit is one
line and exit status 4; the memory flags parse."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from serve_helpers import free_port, wait_healthy

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.memory_plan import plan_memory
from moeserve.cli import build_parser
from moeserve.commands.common import _plan_data, resolve_model, runtime_from_args

MiB = 1 << 20
TOTAL = 8 * 64  # the bundled model's experts


def engine_from(argv: list[str]) -> LLMEngine:
    args = build_parser().parse_args(["serve", *argv])
    return LLMEngine.from_pretrained(resolve_model(args), runtime_from_args(args))


def test_serve_with_only_device_memory_plans_prints_and_serves():
    port = free_port()
    cmd = [sys.executable, "-m", "moeserve", "serve", "--port", str(port), "--device-memory", "128MiB"]
    cmd += ["--log-level", "warning", "--max-wait-ms", "0", "--served-model-name", "tiny", "--enforce-eager"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 90)
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    plan = re.search(r"memory plan: ([\d.]+) MiB of ([\d.]+) MiB .* (\d+) expert slots", err)
    assert plan, err
    used, budget, slots = float(plan[1]), float(plan[2]), int(plan[3])
    assert used <= budget == pytest.approx(0.9 * 128) and 1 <= slots < TOTAL  # experts offloaded
    assert "memory plan why: highest est. decode throughput" in err
    assert f"buffer {slots} slots" in err  # the engine runs the plan's split


def test_engine_on_the_plan_allocates_what_it_planned():
    with engine_from(
        ["--device-memory", "72MiB", "--max-batch-size", "4", "--max-model-len", "256"]
    ) as engine:
        split = engine.memory_split
        plan = plan_memory(engine.config, engine.runtime)
        assert engine.buffer.num_slots == split.slots == sum(plan.buffer_slots) < TOTAL
        assert engine.kv.nbytes == plan.kv_cache == split.kv
        assert plan.dense + plan.activations + plan.kv_cache + split.slots * plan.expert_bytes <= split.budget
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out[0].output_token_ids) == 6


@pytest.mark.parametrize(
    ("flags", "slots", "blocks"),
    [
        (["--buffer-fraction", "0.25"], 128, 64),  # slots fixed: KV the rest, at most 4 x 256 positions
        (["--buffer-slots", "100"], 100, 64),
        (["--kv-cache-memory", "2MiB"], None, 32),  # pool fixed: slots the rest
        (["--num-kv-blocks", "32"], None, 32),
    ],
    ids=["fraction", "slots", "kv-bytes", "kv-blocks"],
)
def test_overrides_reach_the_engine(flags, slots, blocks):
    base = ["--device-memory", "64MiB", "--max-batch-size", "4", "--max-model-len", "256"]
    base += ["--max-num-batched-tokens", "256"]
    with engine_from(base + flags) as engine:
        split = engine.memory_split
        assert engine.kv_manager.num_blocks == blocks == split.num_kv_blocks
        assert engine.buffer.num_slots == (slots or split.slots)
        if slots is None:  # the slots took what the fixed pool left: one more does not fit
            plan = plan_memory(engine.config, engine.runtime)
            left = (
                split.budget - plan.dense - plan.activations - plan.kv_cache - split.slots * plan.expert_bytes
            )
            assert 0 <= left < plan.expert_bytes


def test_dense_part_that_does_not_fit_is_exit_4_and_one_line():
    cmd = [sys.executable, "-m", "moeserve", "serve", "--port", "0", "--device-memory", "50MiB"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stderr
    line = out.stderr.strip()
    assert line.count("\n") == 0 and "Traceback" not in line
    assert re.search(
        r"may take 45.00 MiB of cpu \(0.90 x --device-memory 50.00 MiB\), but the dense part alone needs",
        line,
    )
    assert "dense weights 5.76 MiB" in line and "--max-num-batched-tokens 4096" in line


def test_memory_flags_parse(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--device-memory", "24GiB", "--kv-cache-memory", "500MB"])
    rt = runtime_from_args(args, dtype="fp32")
    assert (rt.device_memory, rt.kv_cache_memory, rt.gpu_memory_utilization) == (24 << 30, 500 * 10**6, 0.9)
    assert rt.buffer_fraction is None and rt.buffer_slots is None
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in (["--device-memory", "lots"], ["--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["serve", *bad])
        assert exc.value.code == 2
    assert "not a size in bytes" in capsys.readouterr().err
    # serve's own recorded traffic is the plan's data when it exists, unless --plan-data says otherwise
    trace, eamc = tmp_path / "t.jsonl", tmp_path / "e.npz"
    args = parser.parse_args(["serve", "--record-trace", str(trace), "--eamc-path", str(eamc)])
    assert _plan_data(args) == ()
    trace.write_text("{}\n")
    eamc.write_bytes(b"PK\x03\x04")
    assert _plan_data(args) == (str(trace), str(eamc))
    args = parser.parse_args(["serve", "--record-trace", str(trace), "--plan-data", "x.jsonl"])
    assert _plan_data(args) == ("x.jsonl",)
