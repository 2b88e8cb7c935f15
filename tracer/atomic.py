"""Atomic file replacement: write a temp file in the target's folder, fsync, ``os.replace``.

A crash mid-write leaves the old file (or none), never a half-written one. The new file gets the
old file's permission bits, or ``0o644`` when there was none (``mkstemp`` would give ``0o600``).
Missing parent folders are created.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_file(path: str | Path, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temp file beside ``path`` for writing; on clean exit it replaces ``path``.

    Raises:
        OSError: the folder cannot be created or is not writable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
