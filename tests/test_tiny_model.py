"""The bundled default model (``moe_runtime/assets/tiny-moe``) and its training recipe."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from moe_runtime.assets import DEFAULT_MODEL_FILES, default_model_dir
from moe_runtime.errors import ConfigError

MAX_BYTES = 40 * 10**6
EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = default_model_dir()
    if not (path / "model.safetensors").exists():
        pytest.fail(f"{path}: the bundled checkpoint is missing")
    return path


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (no __iter__)


def test_default_model_dir_has_all_files(model_dir: Path) -> None:
    assert model_dir == Path(__file__).resolve().parents[1] / "moe_runtime" / "assets" / "tiny-moe"
    for name in DEFAULT_MODEL_FILES:
        assert (model_dir / name).is_file(), name


def test_checkpoint_meets_shape_constraints(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert experts >= 32
    assert 2 <= cfg["num_experts_per_tok"] <= 8
    moe_layers = [
        i
        for i in range(cfg["num_hidden_layers"])
        if i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0
    ]
    assert len(moe_layers) >= 8
    shapes = _tensor_shapes(model_dir)
    numel = {k: int(torch.Size(s).numel()) for k, s in shapes.items()}
    expert_keys = [k for k in shapes if EXPERT_KEY.match(k)]
    assert len(expert_keys) == 3 * experts * len(moe_layers)  # one tensor per expert and projection
    assert sum(numel[k] for k in expert_keys) / sum(numel.values()) >= 0.85
    assert (model_dir / "model.safetensors").stat().st_size <= MAX_BYTES
    with open(model_dir / "model.safetensors", "rb") as f:  # bf16 on disk
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}


def test_loads_in_transformers_with_finite_logits(model_dir: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 300, 1200, 7, 42]]), output_router_logits=True)
    assert out.logits.shape == (1, 5, model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert len(out.router_logits) == model.config.num_hidden_layers


def test_tokenizer_round_trips_and_chat_template(model_dir: Path) -> None:
    from moe_runtime.tokenizer import Tokenizer
    from moeserve.train.tokenizer import EOS_TOKEN, ROLE_TOKENS, render_chat

    tok = Tokenizer(model_dir)
    for text in [
        "def add(a, b):\n    return a + b\n",
        "To be, or not to be: that is the question.",
        "Question: What is 2 + 2?\nAnswer: 4",
        "naïve café — ünïcödé ✓ 数字",
    ]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == [tok._tok.token_to_id(EOS_TOKEN)]
    for marker in ROLE_TOKENS:
        assert len(tok.encode(marker)) == 1
    messages = [{"role": "user", "content": "Name a prime."}]
    assert tok.apply_chat_template(messages) == render_chat(messages, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == "<|user|>\nName a prime.\n<|assistant|>\n"


def test_chat_template_renders_the_same_in_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from moe_runtime.tokenizer import Tokenizer

    ours, theirs = Tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3 + 3?"},
    ]
    for msgs, gen in ((chat, True), (chat[:3], False)):
        expected = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expected
    assert theirs.eos_token == "<|endoftext|>"


def test_training_log_matches_checkpoint(model_dir: Path) -> None:
    log = json.loads((model_dir / "training_log.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    assert log["shape"]["num_experts"] == cfg.get("num_experts", cfg.get("num_local_experts"))
    assert log["evals"][-1]["step"] == log["settings"]["steps"]
    assert all(log["evals"][-1][d] < log["evals"][0][d] for d in ("code", "technical", "literary", "qa"))


def test_corpus_has_zero_overlap_with_replayed_prompts(shared_data: Path) -> None:
    from moeserve.train.corpus import (
        REPLAYED_ROWS,
        OverlapIndex,
        assert_no_overlap,
        build_corpus,
        check_row_ids,
        replayed_prompts,
    )

    split = build_corpus(shared_data)
    prompts = replayed_prompts(shared_data)
    docs = [d for part in (split.train, split.heldout) for ds in part.values() for d in ds]
    check_row_ids(docs, prompts)  # independent re-check of what build_corpus asserted
    assert_no_overlap(split, OverlapIndex(prompts))
    for d in docs:
        if d.source.startswith(("mmlu/", "flan_cot/")) and "/dev/" not in d.source:
            assert int(d.source.rsplit("/", 1)[1]) >= REPLAYED_ROWS, d.source
    train_sources = {d.source for ds in split.train.values() for d in ds}
    assert not train_sources & {d.source for ds in split.heldout.values() for d in ds}
    assert all(split.heldout[d] and split.train[d] for d in split.train)


def test_training_recipe_writes_loadable_checkpoint(tmp_path: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    from moe_runtime.loader import load_checkpoint
    from moeserve.train.corpus import DOMAINS, CorpusSplit, Doc
    from moeserve.train.shape import TinyMoeShape, TrainSettings
    from moeserve.train.trainer import train

    texts = {
        "code": "def f(x):\n    return x + 1\n",
        "technical": "The for statement iterates.\n",
        "literary": "ROMEO:\nBut soft, what light through yonder window breaks?\n",
        "qa": "Question: 2 + 2?\nAnswer: 4\n",
    }
    split = CorpusSplit(
        train={d: [Doc(d, f"{d}/{i}", texts[d] * 4 + str(i)) for i in range(12)] for d in DOMAINS},
        heldout={d: [Doc(d, f"{d}/h{i}", texts[d] * 4) for i in range(3)] for d in DOMAINS},
    )
    shape = TinyMoeShape(
        vocab_size=300,
        hidden_size=32,
        num_layers=2,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    )
    settings = TrainSettings(
        steps=4,
        batch_size=4,
        seq_len=32,
        warmup_steps=1,
        eval_every=2,
        eval_windows=2,
        log_every=2,
        threads=1,
    )
    log = train(split, tmp_path, shape, settings, log=lambda _: None)
    assert {*DEFAULT_MODEL_FILES, "training_log.json"} <= {p.name for p in tmp_path.iterdir()}
    assert log["evals"][-1]["step"] == 4 and len(log["curve"]) == 2
    assert any(EXPERT_KEY.match(k) for k in _tensor_shapes(tmp_path))
    model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
    assert load_checkpoint(tmp_path).config.num_experts == 8  # our runtime reads it too
    again = train(split, tmp_path / "again", shape, settings, log=lambda _: None)
    assert again["curve"] == [
        {**c, "elapsed_s": a["elapsed_s"]} for c, a in zip(log["curve"], again["curve"])
    ]
    assert (tmp_path / "model.safetensors").read_bytes() == (
        tmp_path / "again" / "model.safetensors"
    ).read_bytes()


def test_train_tiny_without_transformers_says_how_to_install(monkeypatch) -> None:
    from moeserve.commands import train_tiny

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"pip install 'moeserve\[train\]'"):
        train_tiny._require_transformers()
