"""Paths as printed in settings lines and docs: never an absolute path of the machine that ran."""

from __future__ import annotations

from pathlib import Path


def shown_path(path: str | Path) -> str:
    """``path`` relative to the working folder when under it, else its last component.

    Settings lines end up in ``docs/``; an absolute path there names a folder of one machine and
    leaks its layout. Example: ``/home/u/repo/runs/x.json`` run from ``/home/u/repo`` ->
    ``runs/x.json``; ``/tmp/ckpt`` -> ``ckpt``.
    """
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name
