"""Task-labelled prompt files (JSONL of ``{dataset, task, prompt}``) for the runtime benchmarks."""

from __future__ import annotations

import json
from pathlib import Path


def prompts_by_task(path: Path) -> dict[str, list[str]]:
    """``"dataset/task" -> [prompt, ...]`` in file order.

    Raises:
        ConfigError: the file is missing or a row is not a ``{dataset, task, prompt}`` object
            (names the file and line).
    """
    from moe_runtime.errors import ConfigError

    if not path.exists():
        raise ConfigError(f"--prompts {path}: file not found")
    by_task: dict[str, list[str]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            by_task.setdefault(f"{row['dataset']}/{row['task']}", []).append(row["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: bad prompt row ({exc})") from None
    return by_task
