"""EAMC files: save atomically, load with a model-fingerprint check (MoE-Infinity §5.3).

File layout (numpy ``.npz``, no pickle): ``meta`` is a 0-d unicode array holding one JSON object
``{"format": "moeserve-eamc/1", "fingerprint": {...}, "capacity": C, "index": "flat"}`` (plus
``nlist``/``nprobe`` for an IVF collection), and
``entries`` is the ``(n, L * E)`` float32 matrix of stored entries, each ``E``-wide row
L2-normalised (or zero). The fingerprint always holds ``num_layers`` and ``num_experts``; the
runtime adds what identifies the model (architecture, ...). A save writes a temp file in the same
folder and ``os.replace``s it over the target, so a crash never leaves a half-written EAMC.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from tracer.atomic import atomic_file
from tracer.errors import TracerError

FORMAT = "moeserve-eamc/1"
_NORM_TOL = 1e-3


class CorruptEAMCError(TracerError):
    """The file exists but is not a readable EAMC: damaged, misshaped or implausible fields.

    Not raised for a missing file, a directory, or an EAMC of another model (plain
    :class:`TracerError`): only a corrupt file may be replaced (``--eamc-on-corrupt reset``).
    """


class StoredEAMC(Protocol):
    """What saving and loading use of a collection (:class:`tracer.eamc.EAMC`)."""

    num_layers: int
    num_experts: int
    dim: int
    index_kind: str
    fingerprint: dict[str, Any]
    _ivf: Any

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def entries(self) -> np.ndarray: ...

    def _restore(self, entries: np.ndarray) -> None: ...


C = TypeVar("C", bound=StoredEAMC)


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_eamc_size(capacity: int, num_layers: int, num_experts: int, what: str) -> None:
    """Refuse a collection whose ``[capacity, L * E]`` float32 matrix exceeds host memory.

    Raises:
        TracerError: one line naming ``what`` (the file and field), the bytes needed and the
            host's memory.
    """
    need = capacity * num_layers * num_experts * 4
    have = host_memory_bytes()
    if have is not None and need > have:
        raise TracerError(
            f"{what} is {capacity}: {capacity} x {num_layers} layers x {num_experts} experts needs "
            f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of host memory"
        )


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d))


def save_eamc(eamc: StoredEAMC, path: str | Path, fingerprint: dict[str, Any] | None = None) -> None:
    """Write ``eamc`` to ``path`` atomically; see the module docstring for the layout.

    Raises:
        ValueError: ``fingerprint`` gives ``num_layers``/``num_experts`` other than the EAMC's.
        OSError: the folder is not writable.
    """
    path = Path(path)
    fp = dict(eamc.fingerprint if fingerprint is None else fingerprint)
    for key, value in (("num_layers", eamc.num_layers), ("num_experts", eamc.num_experts)):
        if fp.setdefault(key, value) != value:
            raise ValueError(f"fingerprint {key}={fp[key]!r} but the EAMC has {key}={value}")
    meta: dict[str, Any] = {
        "format": FORMAT,
        "fingerprint": fp,
        "capacity": eamc.capacity,
        "index": eamc.index_kind,
    }
    if eamc._ivf is not None:
        meta.update(nlist=eamc._ivf.nlist, nprobe=eamc._ivf.nprobe)
    entries = np.ascontiguousarray(eamc.entries().reshape(len(eamc), eamc.dim))
    with atomic_file(path, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta, sort_keys=True)), entries=entries)


def _read(path: Path) -> tuple[dict[str, Any], np.ndarray]:
    with path.open("rb") as f:
        if f.read(4) != b"PK\x03\x04":
            raise TracerError(f"{path}: corrupt EAMC file (not an .npz archive)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"meta", "entries"} - set(z.files)
            if missing:
                raise TracerError(f"{path}: not an EAMC file (no {', '.join(sorted(missing))} array)")
            meta_arr, entries = z["meta"], z["entries"]
    except TracerError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise TracerError(f"{path}: corrupt EAMC file ({type(exc).__name__}: {first})") from None
    try:
        meta = json.loads(str(meta_arr[()]))
    except (ValueError, TypeError, IndexError):
        raise TracerError(f"{path}: corrupt EAMC file (field 'meta' is not JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise TracerError(f"{path}: field 'format' is {fmt!r}, expected {FORMAT!r}")
    return meta, entries


def _check_meta(path: Path, meta: dict[str, Any], entries: np.ndarray) -> tuple[int, int, int]:
    fp = meta.get("fingerprint")
    if not isinstance(fp, dict):
        raise TracerError(f"{path}: field 'fingerprint' is missing or not an object")
    dims = [fp.get("num_layers"), fp.get("num_experts"), meta.get("capacity")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dims):
        raise TracerError(f"{path}: fields num_layers/num_experts/capacity must be positive ints, got {dims}")
    num_layers, num_experts, capacity = dims
    if entries.dtype != np.float32 or entries.ndim != 2 or entries.shape[1] != num_layers * num_experts:
        raise TracerError(
            f"{path}: field 'entries' must be float32 (n, {num_layers * num_experts}), "
            f"got {entries.dtype} {entries.shape}"
        )
    if meta.get("index", "flat") not in ("flat", "ivf"):
        raise TracerError(f"{path}: field 'index' is {meta.get('index')!r}, expected 'flat' or 'ivf'")
    if entries.shape[0] > capacity:
        raise TracerError(
            f"{path}: field 'entries' holds {entries.shape[0]} rows, more than capacity {capacity}"
        )
    if not np.isfinite(entries).all():
        raise TracerError(f"{path}: field 'entries' holds NaN or infinite values")
    norms = np.linalg.norm(entries.reshape(-1, num_experts), axis=1)
    bad = ~((np.abs(norms - 1.0) < _NORM_TOL) | (norms == 0.0))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise TracerError(
            f"{path}: field 'entries': entry {row // num_layers} layer {row % num_layers} is not "
            f"L2-normalised (norm {norms[row]:.4f})"
        )
    return num_layers, num_experts, capacity


def load_eamc(cls: type[C], path: str | Path, fingerprint: dict[str, Any] | None = None, **kwargs: Any) -> C:
    """Read an EAMC file written by :func:`save_eamc`.

    Args:
        cls: the EAMC class to build.
        path: the file.
        fingerprint: when given, every field of it must equal the file's fingerprint field.
        kwargs: constructor overrides (``capacity``, ``index``, ``threads``, ``nlist``, ``nprobe``).

    Raises:
        CorruptEAMCError: the file is damaged or its fields are misshaped or implausible (a
            capacity whose matrix would not fit in host memory).
        TracerError: a missing file, a directory, or a fingerprint of another model (one line
            naming the file and the field).
    """
    path = Path(path)
    if path.is_dir():
        raise TracerError(f"{path}: is a directory, not an EAMC file")
    if not path.is_file():
        raise TracerError(f"{path}: no such EAMC file")
    try:
        meta, entries = _read(path)
        num_layers, num_experts, capacity = _check_meta(path, meta, entries)
        check_eamc_size(capacity, num_layers, num_experts, f"{path}: field 'capacity'")
    except OSError as exc:
        raise TracerError(f"{path}: cannot read the EAMC file ({exc.strerror or exc})") from None
    except TracerError as exc:
        raise CorruptEAMCError(str(exc)) from None
    stored = meta["fingerprint"]
    if fingerprint is not None:
        for key, want in _jsonable(fingerprint).items():
            if key not in stored:
                raise TracerError(f"{path}: EAMC of another model: fingerprint has no field '{key}'")
            if stored[key] != want:
                raise TracerError(
                    f"{path}: EAMC of another model: fingerprint field '{key}' is {stored[key]!r}, "
                    f"expected {want!r}"
                )
    kwargs.setdefault("capacity", capacity)
    kwargs.setdefault("index", meta.get("index", "flat"))
    if kwargs["index"] == "ivf":
        for key in ("nlist", "nprobe"):
            if isinstance(meta.get(key), int) and meta[key] > 0:
                kwargs.setdefault(key, meta[key])
    if kwargs["capacity"] < entries.shape[0]:
        raise TracerError(
            f"{path}: holds {entries.shape[0]} entries, more than capacity {kwargs['capacity']}"
        )
    fp = {k: v for k, v in stored.items() if k not in ("num_layers", "num_experts")}
    eamc = cls(num_layers, num_experts, fingerprint=fp, **kwargs)
    eamc._restore(entries)
    return eamc
