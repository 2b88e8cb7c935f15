"""Model family registry, keyed by ``config.json`` ``architectures[0]`` and ``model_type``.

Adding a family: one file holding its config parser and name quirks, then one line in
:data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from moe_runtime.errors import ConfigError
from moe_runtime.models import mixtral, olmoe, qwen2_moe, qwen3_moe
from moe_runtime.models.base import ExpertTensor, Family

FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in (mixtral, qwen2_moe, qwen3_moe, olmoe)}

__all__ = ["FAMILIES", "ExpertTensor", "Family", "family_for"]


def family_for(cfg: dict[str, Any], source: str = "config.json") -> Family:
    """Pick the family serving a ``config.json`` dict.

    Raises:
        ConfigError: when neither ``architectures[0]`` nor ``model_type`` is supported.
    """
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    for fam in FAMILIES.values():
        if (archs and archs[0] in fam.architectures) or model_type in fam.model_types:
            return fam
    known = ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    raise ConfigError(
        f"{source}: unsupported architecture {archs[0] if archs else model_type!r} (supported: {known})"
    )
