"""``tools/gpu_check.sh``: bash accepts it, every step is declared with a name and a timeout, every
``moeserve`` command in it parses with the real argument parser, and a run with a stand-in
``python3`` (no GPU needed) goes through every step: a failing step does not stop the rest, the
optional benches run only where ``moeserve bench --help`` lists them, the budget skips late steps."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from moeserve.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")  # fmt: skip
#: Benches the script runs only where this tree has them.
OPTIONAL_BENCHES = {"cpu-experts", "kv"}


def _lines() -> list[str]:
    """The script's lines, backslash continuations joined."""
    return SCRIPT.read_text().replace("\\\n", " ").splitlines()


def _bench_names() -> set[str]:
    parser = build_parser()
    top = next(a for a in parser._subparsers._group_actions if hasattr(a, "choices"))  # noqa: SLF001
    bench = top.choices["bench"]
    return set(next(a for a in bench._subparsers._group_actions if hasattr(a, "choices")).choices)  # noqa: SLF001


def _moeserve_commands() -> list[list[str]]:
    """Every ``python3 -m moeserve ...`` of the script as argv after ``moeserve``, the ``DECODE``
    array spliced in, shell variables replaced by stand-in words, ended at a redirection or ``&``."""
    text = "\n".join(_lines())
    decode = re.search(r"^DECODE=\((.*?)\)$", text, flags=re.M | re.S).group(1)
    text = text.replace('"${DECODE[@]}"', decode)
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"python3 -m moeserve (.*)", line):
            stand_in = lambda v: "8000" if v.group(1) == "port" else f"X{v.group(1)}"  # noqa: E731
            words = shlex.split(re.sub(r"\$\{?(\w+)\}?", stand_in, m.group(1).replace('"', "")))
            argv = []
            for w in words:
                if w in {"&", ">", "2>", ">>", "2>&1", "||", "&&", ";"} or w.startswith((">", "2>")):
                    break
                argv.append(w)
            out.append(argv)
    return out


def test_bash_accepts_the_script() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().splitlines()[1].startswith("# Check this tree on a CUDA machine")


def test_every_step_has_a_unique_name_and_a_timeout() -> None:
    steps = [ln.split()[:3] for ln in _lines() if re.match(r"\s*(step|background) \S+ \d+ ", ln)]
    names = [s[1] for s in steps]
    assert len(names) == len(set(names)) >= 10
    assert {"gpu-tests.log", "decode-cuda-tiny-moe.json", "decode-cuda-qwen3-30b-a3b-8l.json",
            "decode-cuda-mixtral-8x7b-4l.json", "replay-cuda-qwen3-30b-a3b-8l.txt",
            "bench-cpu-experts.json", "bench-kv-cuda.json"} <= set(names)  # fmt: skip
    assert all(0 < int(s[2]) <= 360 for s in steps)
    # the timed steps in a row fit the 8 minutes even if each runs to its timeout but the budget cuts
    assert re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET_S:-(\d+)\}", SCRIPT.read_text()).group(1) == "450"


def test_its_moeserve_commands_parse() -> None:
    commands = _moeserve_commands()
    subs = {tuple(c[:2]) if c[0] == "bench" else (c[0],) for c in commands}
    assert {("bench", "decode"), ("make-checkpoint",), ("serve",), ("replay",), ("--version",)} <= subs
    benches = _bench_names()
    for argv in commands:
        if argv[0] == "bench" and argv[1] in OPTIONAL_BENCHES and argv[1] not in benches:
            continue  # not in this tree yet; the script checks `moeserve bench --help` first
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            if argv[-1] != "--help" and argv != ["--version"]:
                pytest.fail(f"moeserve {' '.join(argv)}: does not parse ({exc})")


FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$*" in
  "-m pip show"*) exit 0 ;;
  "-m pytest"*) echo "1 failed"; exit 1 ;;
  "-m moeserve bench --help") printf '    decode    TPOT\n    kv        paged KV cache\n' ;;
  "-m moeserve bench decode"*) echo '{"settings": {}}' ;;
  "-m moeserve serve"*) exec sleep 30 ;;
  "-m moeserve replay"*) echo "replay summary" ;;
  *) echo "python3 $*" ;;
esac
"""


def _run(tmp_path: Path, budget: int = 450, **extra_env: str) -> tuple[str, str, Path]:
    bin_dir, data, out = tmp_path / "bin", tmp_path / "data", tmp_path / "out"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    data.mkdir()
    (data / "AzureLLMInferenceTrace_conv.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    (data / "prompts_combined.jsonl").write_text("{}\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls"),
           "TMPDIR": str(tmp_path), "GPU_CHECK_BUDGET_S": str(budget), "GPU_CHECK_PORT": "18999",
           "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"), **extra_env}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--data", str(data), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text()
    return (out / "summary.txt").read_text(), calls, out


def test_a_run_goes_through_every_step(tmp_path: Path) -> None:
    summary, calls, out = _run(tmp_path)
    lines = summary.splitlines()
    assert lines[0].startswith("gpu-tests.log: rc=1")  # a failing step ...
    steps = (
        "decode-cuda-tiny-moe.json",
        "launches-cuda-tiny-moe.json",
        "decode-cuda-tiny-moe-eager.json",
        "ckpt-qwen3-30b-a3b-8l",
        "decode-cuda-qwen3-30b-a3b-8l.json",
        "replay-cuda-qwen3-30b-a3b-8l.txt",
        "ckpt-mixtral-8x7b-4l",
        "decode-cuda-mixtral-8x7b-4l.json",
        "bench-kv-cuda.json",
    )
    for name in steps:
        assert f"{name}: rc=0" in summary  # ... does not stop the rest
    assert "cpu-experts" not in summary and lines[-1].startswith("done")
    assert (out / "decode-cuda-tiny-moe.json").read_text() == '{"settings": {}}\n'
    assert (out / "replay-cuda-qwen3-30b-a3b-8l.txt").read_text() == "replay summary\n"
    assert "torch" in (out / "machine.txt").read_text()
    assert f"--trace {tmp_path}/data/AzureLLMInferenceTrace_conv.csv" in calls  # the flat data folder
    assert "--model " + str(tmp_path / "moeserve-gpu-check" / "mixtral-4l") in calls
    assert "-m pip install" not in calls  # moeserve installed, no wheels: nothing installed
    assert not (tmp_path / "moeserve-gpu-check").exists()  # the checkpoints removed


def test_the_budget_skips_late_steps(tmp_path: Path) -> None:
    summary, calls, _ = _run(tmp_path, budget=10)
    assert "gpu-tests.log: skipped" in summary and "decode-cuda-mixtral-8x7b-4l.json: skipped" in summary
    assert "-m pytest" not in calls and "bench decode" not in calls


def test_gpu_tests_survive_missing_test_only_imports() -> None:
    """A GPU machine may lack test-only packages (openai, jsonschema: found on an H100, where the
    collection errors stopped every GPU test): the step keeps collecting past them."""
    line = next(x for x in _lines() if "step gpu-tests.log" in x)
    assert "-m gpu" in line and "--continue-on-collection-errors" in line


def test_only_the_selected_steps_run(tmp_path: Path) -> None:
    """``GPU_CHECK_ONLY`` (a rerun within a short lease): the selected steps run, the others are
    noted as not selected, and no checkpoint is written for steps that do not run."""
    summary, calls, _ = _run(tmp_path, GPU_CHECK_ONLY="gpu-tests*,launches-cuda-tiny-moe*")
    ran = [line.split(":")[0] for line in summary.splitlines() if ": rc=" in line]
    assert ran == ["gpu-tests.log", "launches-cuda-tiny-moe.json", "launches-cuda-tiny-moe-eager.json",
                   "launches-cuda-tiny-moe-offloaded.json"]  # fmt: skip
    assert "decode-cuda-tiny-moe.json: not selected by GPU_CHECK_ONLY" in summary
    assert "make-checkpoint" not in calls and "bench decode" not in calls
