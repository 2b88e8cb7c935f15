"""``promtool`` checks of ``deploy/prometheus``: config and rules are valid, rule unit tests pass.

``rules/tests.yml`` feeds synthetic series to the recording and alerting rules (exact hit rates,
blocking per token, quantiles; each alert pending then firing, and silent on an idle server).
Skipped without ``promtool`` (Debian's ``prometheus`` package ships it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROM_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (apt-get install -y prometheus)")


def promtool(*args: str) -> str:
    proc = subprocess.run([PROMTOOL, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{out}"
    return out


def test_check_config() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert "2 rule files found" in out


def test_check_rules() -> None:
    out = promtool("check", "rules", "rules/recording.yml", "rules/alerts.yml")
    assert out.count("SUCCESS") == 2


def test_rule_unit_tests() -> None:
    promtool("test", "rules", "rules/tests.yml")
