"""Paths as printed in settings lines and docs: never an absolute path of the machine that ran."""

from __future__ import annotations

from pathlib import Path

from moe_runtime.hub import cache_repo_id


def shown_path(path: str | Path) -> str:
    """``path`` relative to the working folder when under it, else its last component.

    Settings lines end up in ``docs/``; an absolute path there names a folder of one machine and
    leaks its layout. Example: ``/home/u/repo/runs/x.json`` run from ``/home/u/repo`` ->
    ``runs/x.json``; ``/tmp/ckpt`` -> ``ckpt``; a snapshot in a Hugging Face cache
    (``.../models--org--name/snapshots/<rev>``) -> ``org/name``.
    """
    path = Path(path)
    repo_id = cache_repo_id(path)
    if repo_id is not None:  # a model in a Hugging Face cache: its repo id, not the commit hash
        return repo_id
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name
