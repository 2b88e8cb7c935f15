"""Shared fixtures: tiny checkpoints of every family, built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_checkpoint  # noqa: E402

torch.set_num_threads(1)  # tiny tensors: thread fan-out only costs time on a 2-core machine

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> folder of a tiny random checkpoint (2 layers, 8 experts, top-2, tokenizer)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_checkpoint(f, root / f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoints) -> Path:
    return tiny_checkpoints["qwen3_moe"]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA
