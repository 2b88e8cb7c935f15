"""The server's EAMC file: path checked at start, stale temp files removed, implausible or corrupt
files refused with one line (or reset on request), failed saves counted and never fatal."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from moe_runtime.errors import ConfigError
from moeserve.cli import main
from server.testing import free_port, wait_until_healthy
from server.tracing import TraceHooks, build_tracing, check_eamc_path, model_fingerprint
from tracer.eamc import EAMC
from tracer.eamc_store import CorruptEAMCError
from tracer.errors import TracerError

CFG = SimpleNamespace(architecture="Qwen3MoeForCausalLM", num_moe_layers=2, num_experts=4, top_k=2)


def _saved(path: Path, entries: int = 2) -> EAMC:
    eamc = EAMC(CFG.num_moe_layers, CFG.num_experts, capacity=8, fingerprint=model_fingerprint(CFG))
    for i in range(entries):
        eam = np.zeros((CFG.num_moe_layers, CFG.num_experts))
        eam[:, i % CFG.num_experts] = 1.0
        eamc.add(eam)
    eamc.save(path)
    return eamc


def test_path_checks_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; give a file path"):
        check_eamc_path(tmp_path)
    with pytest.raises(ConfigError, match="missing does not exist"):
        check_eamc_path(tmp_path / "missing" / "eamc.npz")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="file is not a folder"):
        check_eamc_path(tmp_path / "file" / "eamc.npz")
    with pytest.raises(ConfigError, match=r"cannot write in /proc"):  # unwritable even for root
        check_eamc_path(Path("/proc/eamc.npz"))
    check_eamc_path(tmp_path / "eamc.npz")  # a new file in a writable folder is fine
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # the write probe left nothing


def test_stale_temp_files_are_removed_at_start(tmp_path):
    path = tmp_path / "eamc.npz"
    _saved(path)
    stale = [tmp_path / ".eamc.npz.k9x1.tmp", tmp_path / ".eamc.npz.zz.tmp"]
    keep = [tmp_path / ".other.npz.k9x1.tmp", tmp_path / "eamc.npz.bak"]
    for p in stale + keep:
        p.write_bytes(b"half a save")
    check_eamc_path(path)
    assert sorted(tmp_path.iterdir()) == sorted([path, *keep])
    assert len(EAMC.load(path)) == 2  # the real file untouched


def test_cli_refuses_an_unusable_path_before_loading(tiny_qwen3, tmp_path, capsys):
    assert main(["serve", "--model", str(tiny_qwen3), "--eamc-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeserve: error: --eamc-path") and "is a directory" in err
    assert len(err.splitlines()) == 1


def _rewrite_meta(path: Path, **fields) -> None:
    with np.load(path) as z:
        meta, entries = json.loads(str(z["meta"][()])), z["entries"]
    meta.update(fields)
    with path.open("wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), entries=entries)


def test_huge_claimed_capacity_and_directories_are_clear_errors(tmp_path):
    path = tmp_path / "eamc.npz"
    _saved(path)
    _rewrite_meta(path, capacity=10**12)
    with pytest.raises(CorruptEAMCError, match=r"field 'capacity' is 1000000000000: .* GiB of host memory"):
        EAMC.load(path)
    with pytest.raises(TracerError, match="is a directory, not an EAMC file") as info:
        EAMC.load(tmp_path)
    assert not isinstance(info.value, CorruptEAMCError)


def test_on_corrupt_fail_or_reset(tmp_path, caplog):
    path = tmp_path / "eamc.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ConfigError, match=r"corrupt EAMC file .*--eamc-on-corrupt reset starts empty"):
        build_tracing(CFG, 16, None, path, on_corrupt="fail")
    with caplog.at_level(logging.ERROR, logger="moeserve.server"):
        _, eamc, _ = build_tracing(CFG, 16, None, path, on_corrupt="reset")
    assert len(eamc) == 0 and eamc.capacity == 16
    assert "starting with an empty EAMC" in caplog.text
    _saved(path)
    with pytest.raises(ConfigError, match="EAMC of another model"):  # never reset another model's file
        build_tracing(SimpleNamespace(**{**vars(CFG), "architecture": "Other"}), 16, None, path, "reset")
    with pytest.raises(ConfigError, match="--eamc-capacity is 1000000000000: .* host memory"):
        build_tracing(CFG, 10**12, None, tmp_path / "new.npz")


class _Engine:
    """What TraceHooks reads from an engine: finished-request counts."""

    def __init__(self) -> None:
        self.stats = SimpleNamespace(requests_finished={"stop": 0})


def test_failed_saves_are_counted_logged_once_and_fail_the_final_save(tmp_path, caplog):
    folder = tmp_path / "gone"
    folder.mkdir()
    engine = _Engine()
    eamc = _saved(folder / "eamc.npz")
    hooks = TraceHooks(engine, folder / "eamc.npz", save_every=1, eamc=eamc)
    shutil.rmtree(folder)  # e.g. the volume went away, and a file took its name (no folder can be made)
    folder.write_text("not a folder")
    with caplog.at_level(logging.ERROR, logger="moeserve.server"):
        for _ in range(3):
            engine.stats.requests_finished["stop"] += 1
            hooks.after_step()
    assert hooks.eamc_saves() == (0, 3)
    assert len([r for r in caplog.records if "cannot save the EAMC" in r.getMessage()]) == 1
    hooks.close()
    assert hooks.final_save_failed and "cannot save the EAMC" in hooks.last_save_error
    folder.unlink()
    folder.mkdir()
    assert hooks.save() and hooks.eamc_saves() == (1, 4) and hooks.last_save_error is None
    assert len(EAMC.load(folder / "eamc.npz")) == 2


def test_serve_exits_1_when_the_final_save_fails(tiny_qwen3, tmp_path):
    folder = tmp_path / "volume"
    folder.mkdir()
    port = free_port()
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", str(tiny_qwen3), "--port", str(port)]
    cmd += ["--log-level", "warning", "--eamc-path", str(folder / "eamc.npz"), "--enforce-eager"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc)
        shutil.rmtree(folder)  # the volume went away while serving, and a file took its name
        folder.write_text("not a folder")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("moeserve: error: ") and "cannot save the EAMC" in last
