"""EAMC files: exact round trip, model fingerprint check, corrupt files refused (TracerError)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracer.eamc import EAMC
from tracer.errors import TracerError
from tracer.synth import synthetic_eams

L, E = 3, 6
FP = {"architecture": "MixtralForCausalLM", "hidden_size": 64}


def _filled(n: int, capacity: int = 10, seed: int = 0) -> EAMC:
    eamc = EAMC(L, E, capacity=capacity, fingerprint=FP)
    for eam in synthetic_eams(n, L, E, tokens=(2, 20), groups=4, seed=seed):
        eamc.add(eam)
    return eamc


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 25), seed=st.integers(0, 100))
def test_save_load_round_trips_exactly(tmp_path: Path, n: int, seed: int) -> None:
    eamc = _filled(n, seed=seed)
    path = tmp_path / "eamc.npz"
    eamc.save(path)
    back = EAMC.load(path, FP)
    assert (back.num_layers, back.num_experts, back.capacity, len(back)) == (L, E, 10, len(eamc))
    np.testing.assert_array_equal(back.entries(), eamc.entries())
    assert back.fingerprint == eamc.fingerprint
    q = np.ones((1, L, E))
    if len(eamc):
        assert back.search(q, k=3)[1].tolist() == eamc.search(q, k=3)[1].tolist()
    assert [p.name for p in tmp_path.iterdir()] == ["eamc.npz"]  # no temp file left behind


def test_save_without_fingerprint_and_load_without_check(tmp_path: Path) -> None:
    eamc = EAMC(L, E, capacity=4)
    eamc.add(np.ones((L, E)))
    eamc.save(tmp_path / "a.npz")
    back = EAMC.load(tmp_path / "a.npz")
    assert back.fingerprint == {"num_layers": L, "num_experts": E} and len(back) == 1
    assert (tmp_path / "a.npz").stat().st_mode & 0o777 == 0o644


def test_other_model_refused(tmp_path: Path) -> None:
    path = tmp_path / "eamc.npz"
    _filled(3).save(path)
    with pytest.raises(TracerError, match=r"eamc\.npz: EAMC of another model: fingerprint field 'arch"):
        EAMC.load(path, {**FP, "architecture": "Qwen3MoeForCausalLM"})
    with pytest.raises(TracerError, match="field 'num_experts' is 6, expected 8"):
        EAMC.load(path, {"num_experts": 8})
    with pytest.raises(TracerError, match="has no field 'vocab_size'"):
        EAMC.load(path, {"vocab_size": 100})


def _rewrite(path: Path, meta: dict | None = None, entries: np.ndarray | None = None) -> None:
    with np.load(path) as z:
        old_meta, old_entries = json.loads(str(z["meta"][()])), z["entries"]
    np.savez(
        path.open("wb"),
        meta=np.array(json.dumps(old_meta if meta is None else meta)),
        entries=old_entries if entries is None else entries,
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        ("garbage", "not an .npz archive"),
        ("truncated", "corrupt EAMC file"),
        ("no-entries", "no entries array"),
        ("format", "field 'format'"),
        ("shape", "field 'entries' must be float32"),
        ("not-normalised", "is not L2-normalised"),
        ("nan", "NaN or infinite"),
        ("missing", "no such EAMC file"),
    ],
)
def test_corrupt_file_refused(tmp_path: Path, damage: str, message: str) -> None:
    path = tmp_path / "eamc.npz"
    _filled(5).save(path)
    with np.load(path) as z:
        meta, entries = json.loads(str(z["meta"][()])), z["entries"].copy()
    if damage == "garbage":
        path.write_bytes(b"\x00not a zip at all" * 10)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "no-entries":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("meta.npy", b"")
    elif damage == "format":
        _rewrite(path, meta={**meta, "format": "something-else"})
    elif damage == "shape":
        _rewrite(path, entries=entries[:, :-1])
    elif damage == "not-normalised":
        _rewrite(path, entries=entries * 2)
    elif damage == "nan":
        entries[0, 0] = np.nan
        _rewrite(path, entries=entries)
    elif damage == "missing":
        path.unlink()
    with pytest.raises(TracerError, match=message) as info:
        EAMC.load(path, FP)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_ivf_collection_reloads_its_index(tmp_path: Path) -> None:
    eamc = EAMC(L, E, capacity=200, index="ivf", nlist=4, nprobe=4)
    for eam in synthetic_eams(200, L, E, tokens=(2, 20), groups=4):
        eamc.add(eam)
    eamc.save(tmp_path / "ivf.npz")
    back = EAMC.load(tmp_path / "ivf.npz")
    assert back.index_kind == "ivf" and back._ivf is not None and back._ivf.trained
    q = synthetic_eams(5, L, E, tokens=(2, 20), groups=4, request_seed=7)
    np.testing.assert_allclose(back.search(q, k=1)[0], eamc.search(q, k=1)[0], rtol=1e-5)
