"""Package data: the bundled default model.

``tiny-moe/`` is a small Qwen3-MoE (64 experts per layer, top-4, 8 MoE layers) trained by
``moeserve train-tiny`` on code, technical English, Shakespeare and exam-style QA, so its routing
has real structure (see ``docs/model-card.md``). ``moeserve serve`` / ``moeserve generate`` use it
when ``--model`` is omitted.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-moe"
DEFAULT_MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_model_dir() -> Path:
    """Folder of the bundled default checkpoint (``moe_runtime/assets/tiny-moe``)."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_NAME
