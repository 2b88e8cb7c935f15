"""``python -m moeserve.sim.calibrate`` end to end on a tiny workload (it drives the real
``bench policies`` under the probe, so a change to either breaks this first)."""

from __future__ import annotations

import json

import pytest

from moeserve.sim import calibrate


def test_calibration_runs_and_lru_hits_match_exactly(shared_data, tmp_path, capsys):
    prompts = shared_data / "prompts" / "prompts_combined.jsonl"
    argv = ["--prompts", str(prompts), "--tasks", "1", "--warm", "1", "--eval", "1", "--fractions", "0.25"]
    argv += ["--policies", "on-demand+lru,eam-paper", "--new-tokens", "3", "--out", str(tmp_path), "--json"]
    assert calibrate.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["comparison"]
    assert {(r["policy"], r["costs"]) for r in rows} == {
        (p, c) for p in ("on-demand+lru", "eam-paper") for c in ("offline", "in-run")
    }
    for r in rows:
        if r["policy"] == "on-demand+lru":  # LRU without prefetch does not depend on timing
            assert r["hit_sim"] == pytest.approx(r["hit_runtime"], abs=1e-9)
    assert (tmp_path / "calibration.json").exists() and (tmp_path / "eval.jsonl").exists()


def test_rows_the_simulator_cannot_replay_are_refused(capsys):
    with pytest.raises(SystemExit):
        calibrate.main(["--policies", "eam"])
    assert "router lookahead" in capsys.readouterr().err
