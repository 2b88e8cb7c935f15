"""Typed reads of an untrusted ``config.json``: every field read is type- and range-checked.

A checkpoint folder is untrusted input. JSON gives strings, floats, booleans and nulls where a
size is expected (``"vocab_size": "abc"``, ``"num_hidden_layers": 1e6``); :class:`ConfigFields`
turns each into a :class:`~moe_runtime.errors.ConfigError` naming the field and the value, before
any shape is computed. Integers must be JSON integers (not ``true``, not ``64.0``); floats must be
finite numbers; enumerations must be one of the supported values. Integer sizes take their bounds
from :data:`moe_runtime.config.MODEL_LIMITS`.

A missing field or an explicit ``null`` both mean "use the default" (Hugging Face writes nulls for
unset optional fields); a required field with neither raises.
"""

from __future__ import annotations

import json
import math
from typing import Any

from moe_runtime.config import MODEL_LIMITS
from moe_runtime.errors import ConfigError

_REQUIRED = object()


def show(value: Any) -> str:
    """A JSON rendering of ``value`` for an error message, at most 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ConfigFields:
    """Checked access to a ``config.json`` dict. Messages name the field, not the file: the loader
    prefixes the file's path once for every error raised while parsing.

    Args:
        raw: the parsed ``config.json`` object (or a nested object of it).
        prefix: how messages name ``raw`` when it is nested, e.g. ``"rope_parameters."``.
    """

    def __init__(self, raw: dict[str, Any], prefix: str = "") -> None:
        self.raw, self.prefix = raw, prefix

    def get(self, key: str, *aliases: str) -> tuple[str, Any]:
        """``(key used, value)`` of the first of ``key, *aliases`` that is present and not null."""
        for k in (key, *aliases):
            if self.raw.get(k) is not None:
                return self.prefix + k, self.raw[k]
        return self.prefix + key, None

    def _missing(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise ConfigError(f"required field {self.prefix + key!r} is missing")
        return default

    def integer(self, key: str, *aliases: str, lo: int, hi: int, default: Any = _REQUIRED) -> int:
        """An integer field in ``[lo, hi]``.

        Raises:
            ConfigError: missing (and required), not a JSON integer, or out of range.
        """
        used, value = self.get(key, *aliases)
        if value is None:
            return self._missing(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{used} must be an integer in [{lo}, {hi}], got {show(value)}")
        return value

    def size(self, attr: str, key: str, *aliases: str, default: Any = _REQUIRED) -> int:
        """An integer field bounded by ``MODEL_LIMITS[attr]`` (``attr``: the ModelConfig name)."""
        lo, hi = MODEL_LIMITS[attr]
        return self.integer(key, *aliases, lo=lo, hi=hi, default=default)

    def number(self, key: str, default: Any = _REQUIRED, positive: bool = True) -> float:
        """A finite number (an integer is accepted), ``> 0`` when ``positive``.

        Raises:
            ConfigError: missing (and required), not a number, not finite, or not positive.
        """
        used, value = self.get(key)
        if value is None:
            return self._missing(key, default)
        ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
        if not ok or (positive and value <= 0):
            kind = "a finite number > 0" if positive else "a finite number"
            raise ConfigError(f"{used} must be {kind}, got {show(value)}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        """A JSON ``true``/``false`` (a string such as ``"false"`` is refused, not read as true)."""
        used, value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{used} must be true or false, got {show(value)}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        """A string from ``choices`` (the values this runtime implements)."""
        used, value = self.get(key)
        if value is None:
            return default
        if value not in choices:
            raise ConfigError(f"{used} must be one of {', '.join(choices)} (supported), got {show(value)}")
        return value

    def int_list(self, key: str, lo: int, hi: int, single: bool = False) -> list[int]:
        """A list of integers in ``[lo, hi]`` (``[]`` when absent); with ``single`` a bare integer
        is accepted as a one-element list (``eos_token_id``)."""
        used, value = self.get(key)
        if value is None:
            return []
        items = [value] if single and not isinstance(value, list) else value
        if not isinstance(items, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi for v in items
        ):
            shape = "an integer or a list of integers" if single else "a list of integers"
            raise ConfigError(f"{used} must be {shape} in [{lo}, {hi}], got {show(value)}")
        return list(items)

    def mapping(self, key: str) -> dict[str, Any]:
        """A JSON object (``{}`` when absent)."""
        used, value = self.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{used} must be an object, got {show(value)}")
        return value
