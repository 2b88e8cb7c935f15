"""Model family registry, keyed by ``config.json`` ``architectures[0]`` and ``model_type``.

Adding a family: one file holding its config parser and name quirks, then one line in
:data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from moe_runtime.errors import ConfigError
from moe_runtime.models import deepseek, glm4_moe, gpt_oss, mixtral, olmoe, phimoe, qwen2_moe, qwen3_moe
from moe_runtime.models.base import ExpertTensor, Family
from moe_runtime.models.fields import ConfigFields, show

FAMILIES: dict[str, Family] = {
    fam.name: fam
    for fam in (
        *(m.FAMILY for m in (mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, phimoe, gpt_oss)),
        deepseek.DEEPSEEK_V2,
        deepseek.DEEPSEEK_V3,
    )
}

__all__ = ["FAMILIES", "ConfigFields", "ExpertTensor", "Family", "family_for"]


def family_for(cfg: dict[str, Any]) -> Family:
    """Pick the family serving a ``config.json`` dict.

    Raises:
        ConfigError: ``architectures`` is not a list of strings, ``model_type`` not a string, or
            neither ``architectures[0]`` nor ``model_type`` is supported.
    """
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"architectures must be a list of strings, got {show(archs)}")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"model_type must be a string, got {show(model_type)}")
    for fam in FAMILIES.values():
        if (archs and archs[0] in fam.architectures) or model_type in fam.model_types:
            return fam
    known = ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    raise ConfigError(f"unsupported architecture {archs[0] if archs else model_type!r} (supported: {known})")
