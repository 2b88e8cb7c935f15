"""``moeserve make-checkpoint``: real shapes, loadable by transformers and moeserve alike.

Real shapes are gigabytes per layer, so the written checkpoints here use the test-only
``--shrink 16`` (every width / 16, counts kept); the real shapes are checked as a table against the
published configs and built on the ``meta`` device by transformers.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from moe_runtime.checkpoints.shapes import SHAPES, hf_config
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.sim.models import MODELS
from moeserve.cli import main

# (hidden, layers, heads, kv heads, head_dim, vocab, experts, top-k, expert width, rope theta),
# from each model's config.json on the Hugging Face Hub.
PUBLISHED = {
    "mixtral-8x7b": (4096, 32, 32, 8, 128, 32000, 8, 2, 14336, 1e6),
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 151936, 128, 8, 768, 1e6),
    "qwen2-moe-a2.7b": (2048, 24, 16, 16, 128, 151936, 60, 4, 1408, 1e6),
    "olmoe-1b-7b": (2048, 16, 16, 16, 128, 50304, 64, 8, 1024, 1e4),
}
PROMPT = "The quick brown fox jumps over"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shape_table_matches_published_configs(name):
    s = SHAPES[name]
    got = (s.hidden, s.num_layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.experts, s.top_k)
    assert got + (s.moe_intermediate, s.rope_theta) == PUBLISHED[name]
    assert (s.shared_intermediate > 0) == (name == "qwen2-moe-a2.7b")
    assert s.qk_norm == {"qwen3-30b-a3b": "head", "olmoe-1b-7b": "full"}.get(name, "none")
    if s.sim_profile:  # the simulator's profile of the same model agrees
        p = MODELS[s.sim_profile]
        assert (p.hidden, p.expert_intermediate, p.num_experts, p.top_k) == (
            s.hidden,
            s.moe_intermediate,
            s.experts,
            s.top_k,
        )


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_shape_builds_in_transformers(name):
    s = SHAPES[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(s, 2, "bfloat16"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * s.experts * s.expert_params
    assert 2 * sum(p.numel() for p in model.parameters()) == s.checkpoint_bytes(2, 2)
    assert model.lm_head.weight.shape == (s.vocab, s.hidden)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (s.heads * s.head_dim, s.hidden)
    assert attn.k_proj.weight.shape == (s.kv_heads * s.head_dim, s.hidden)
    assert (attn.q_proj.bias is not None) == s.attention_bias


def _greedy(engine, prompt, n):
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.output_token_ids
    raise AssertionError("no output")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_made_checkpoint_loads_in_both_and_agrees(capsys, tmp_path, name):
    out = tmp_path / "ckpt"
    rc = main(
        [
            "make-checkpoint",
            "--shape",
            name,
            "--layers",
            "2",
            "--out",
            str(out),
            "--dtype",
            "fp32",
            "--shrink",
            "16",
        ]
    )
    assert rc == 0
    summary = capsys.readouterr().out
    assert "distinct top-" in summary
    vocab = SHAPES[name].vocab // 16
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == vocab
    texts = tok.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False)
    assert all(texts), "an id decodes to nothing"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.vocab_size == vocab and hf.config.num_hidden_layers == 2
    prompt = tok.encode(PROMPT)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    with LLMEngine.from_pretrained(
        out, RuntimeConfig(buffer_slots=2, max_model_len=64, max_batch_size=1)
    ) as eng:
        assert eng.tokenizer.encode(PROMPT) == prompt
        assert _greedy(eng, prompt, 12) == ref


def test_routing_is_input_dependent(tmp_path):
    from moe_runtime.checkpoints.shapes import shrunk
    from moe_runtime.checkpoints.writer import write_checkpoint

    rep = write_checkpoint(shrunk(SHAPES["qwen3-30b-a3b"], 16), 1, tmp_path / "q")
    r = rep.routing
    assert r["entropy"] < 0.8  # uniform routing would be 1.0
    assert r["distinct_topk"] > r["tokens"] // 2 and r["experts_used"] > 64
    assert rep.shards == 2 and rep.expert_bytes == 128 * 3 * 128 * 48 * 2
    assert rep.total_bytes == shrunk(SHAPES["qwen3-30b-a3b"], 16).checkpoint_bytes(1, 2)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--shape", "gpt-5", "--layers", "1"], "'gpt-5'"),
        (["--shape", "olmoe-1b-7b", "--layers", "0"], "--layers 0"),
        (["--shape", "olmoe-1b-7b", "--layers", "17"], "--layers 17"),
        (["--shape", "olmoe-1b-7b", "--layers", "1", "--shrink", "3"], "--shrink 3"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, tmp_path, args, needle):
    assert main(["make-checkpoint", *args, "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moeserve: error: ") and needle in err
    assert not (tmp_path / "new").exists()


def test_non_empty_out_refused(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    assert main(["make-checkpoint", "--shape", "olmoe-1b-7b", "--layers", "1", "--out", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
