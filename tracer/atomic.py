"""Atomic file replacement: write a temp file in the target's folder, fsync, ``os.replace``.

A crash mid-write leaves the old file (or none), never a half-written one. The new file gets the
old file's permission bits, or ``0o644`` when there was none (``mkstemp`` would give ``0o600``).
Missing parent folders are created.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_TEMP_SUFFIX = ".tmp"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Delete temp files :func:`atomic_file` left beside ``path`` when a writer was killed.

    Only call this while no other process writes ``path``. Returns the files removed.

    Raises:
        OSError: the folder cannot be listed or a temp file cannot be removed.
    """
    path = Path(path)
    stale = [p for p in path.parent.glob(f"{glob.escape(_temp_prefix(path))}*{_TEMP_SUFFIX}") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


@contextmanager
def atomic_file(path: str | Path, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temp file beside ``path`` for writing; on clean exit it replaces ``path``.

    Raises:
        OSError: the folder cannot be created or is not writable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
