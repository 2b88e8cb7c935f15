"""``moeserve make-checkpoint``: real shapes, loadable by transformers and moeserve alike.

Real shapes are gigabytes per layer, so the written checkpoints here use the test-only
``--shrink 16`` (every width / 16, counts kept); the real shapes are checked as a table against the
published configs and built on the ``meta`` device by transformers.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.loader import read_model_config
from moeserve.checkpoints.shapes import SHAPES, hf_config, shrunk
from moeserve.cli import main
from moeserve.sim.models import MODELS

# (hidden, layers, heads, kv heads, head_dim, vocab, experts, top-k, expert width, rope theta),
# from each model's config.json on the Hugging Face Hub.
PUBLISHED = {
    "mixtral-8x7b": (4096, 32, 32, 8, 128, 32000, 8, 2, 14336, 1e6),
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 151936, 128, 8, 768, 1e6),
    "qwen2-moe-a2.7b": (2048, 24, 16, 16, 128, 151936, 60, 4, 1408, 1e6),
    "olmoe-1b-7b": (2048, 16, 16, 16, 128, 50304, 64, 8, 1024, 1e4),
}
#: the shapes beyond the Llama layout: (hidden, layers, heads, kv heads, vocab, experts, top-k, expert
#: width, dense width, rope theta) and their family fields, from each model's config.json on the Hub
PUBLISHED_EXTRA = {
    "deepseek-v2-lite": (
        (2048, 27, 16, 16, 102400, 64, 6, 1408, 10944, 1e4),
        dict(
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            routed_scaling_factor=1.0,
        ),
    ),
    "deepseek-v3": (
        (7168, 61, 128, 128, 129280, 256, 8, 2048, 18432, 1e4),
        dict(
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_head_dim=64,
            n_shared_experts=1,
            first_k_dense_replace=3,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        ),
    ),
    "glm-4.5-air": (
        (4096, 46, 96, 8, 151552, 128, 8, 1408, 10944, 1e6),
        dict(
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            partial_rotary_factor=0.5,
            use_qk_norm=False,
        ),
    ),
    "gpt-oss-20b": (
        (2880, 24, 64, 8, 201088, 32, 4, 2880, 0, 150000.0),
        dict(sliding_window=128, swiglu_limit=7.0),
    ),
    "phi-3.5-moe": (
        (4096, 32, 32, 8, 32064, 16, 2, 6400, 0, 1e4),
        dict(lm_head_bias=True, router_jitter_noise=0.01, sliding_window=131072),
    ),
}
SERVED = {  # made shape -> (our family, MoE layers of a 4-layer checkpoint)
    "deepseek-v2-lite": ("deepseek_v2", [1, 2, 3]),
    "deepseek-v3": ("deepseek_v3", [3]),
    "glm-4.5-air": ("glm4_moe", [1, 2, 3]),
    "phi-3.5-moe": ("phimoe", [0, 1, 2, 3]),
    "gpt-oss-20b": ("gpt_oss", [0, 1, 2, 3]),
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


@pytest.mark.parametrize("name", list(PUBLISHED_EXTRA))
def test_family_shapes_match_published_configs(name):
    s = SHAPES[name]
    numbers, fields = PUBLISHED_EXTRA[name]
    got = (s.hidden, s.num_layers, s.heads, s.kv_heads, s.vocab, s.experts, s.top_k, s.moe_intermediate)
    assert got + (s.dense_intermediate, s.rope_theta) == numbers
    assert {k: s.extra[k] for k in fields} == fields
    assert s.shared_intermediate == s.extra.get("n_shared_experts", 0) * s.moe_intermediate


@pytest.mark.parametrize("name", list(SERVED))
def test_family_shape_configs_parse_to_real_shapes(tmp_path, name):
    """The config.json written for 4 layers of each real shape (no weights: real widths are
    gigabytes) is read by our family with the real sizes, dense-first layers and routing."""
    s = SHAPES[name]
    hf_config(s, 4, "bfloat16").save_pretrained(tmp_path)
    family, cfg, _ = read_model_config(tmp_path)
    assert (family.name, cfg.moe_layers) == SERVED[name]
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (
        s.hidden,
        s.experts,
        s.top_k,
        s.moe_intermediate,
    )
    assert cfg.shared_expert_intermediate_size == s.shared_intermediate
    assert cfg.vocab_size == s.vocab and cfg.num_heads == s.heads and cfg.rope_theta == s.rope_theta
    if cfg.mla is not None:
        assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank or None) == (
            s.extra["kv_lora_rank"],
            s.extra["q_lora_rank"],
        )
        assert cfg.mla.yarn.factor == 40 and cfg.routing.n_group == s.extra.get("n_group", 1)
    if name == "glm-4.5-air":
        assert cfg.rotary_dim == 64 and cfg.routing.score_bias and cfg.attention_bias
    if name == "phi-3.5-moe":
        assert (
            cfg.norm == "layer" and cfg.lm_head_bias and cfg.longrope.original_max_position_embeddings == 4096
        )


@pytest.mark.parametrize("name", list(PUBLISHED_EXTRA))
def test_family_shape_builds_in_transformers(name):
    """Real widths on the meta device: every MoE layer holds E experts of ``3 * H * I`` (+ gpt-oss'
    expert biases), dense-first layers hold none."""
    s = SHAPES[name]
    layers = s.first_dense + 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(s, layers, "bfloat16"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    biases = s.experts * (2 * s.moe_intermediate + s.hidden) if name == "gpt-oss-20b" else 0
    assert experts == s.experts * s.expert_params + biases
    assert model.lm_head.weight.shape == (s.vocab, s.hidden)
    assert (model.lm_head.bias is not None) == s.extra.get("lm_head_bias", False)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_shape_builds_in_transformers(name):
    s = SHAPES[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(s, 2, "bfloat16"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * s.experts * s.expert_params
    assert model.lm_head.weight.shape == (s.vocab, s.hidden)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (s.heads * s.head_dim, s.hidden)
    assert attn.k_proj.weight.shape == (s.kv_heads * s.head_dim, s.hidden)
    assert (attn.q_proj.bias is not None) == s.attention_bias


@pytest.mark.parametrize("name", list(SHAPES))
def test_layer_params_count_the_meta_model(name):
    """Per-layer counts and checkpoint bytes equal what transformers' model of the shape holds (its
    ``state_dict``, as written), at real widths on the meta device: dense-first layers, latent
    attention, shared experts, sinks, router and expert biases included."""
    s = SHAPES[name]
    layers = s.first_dense + 2  # the dense-first layers and two MoE layers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(s, layers, "bfloat16"))
    sd = model.state_dict()
    per_layer = [sum(t.numel() for k, t in sd.items() if f".layers.{i}." in k) for i in range(layers)]
    assert per_layer == [s.layer_params(i) for i in range(layers)]
    assert 2 * sum(t.numel() for t in sd.values()) == s.checkpoint_bytes(layers, 2)
    assert s.layer_params(layers - 1) > s.experts * s.expert_params  # the MoE layer holds more
    with pytest.raises(ValueError, match=f"layer {s.num_layers} "):
        s.layer_params(s.num_layers)
    with pytest.raises(ValueError, match="0 layers"):
        s.checkpoint_bytes(0, 2)


def _greedy(engine, prompt, n):
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.output_token_ids
    raise AssertionError("no output")


@pytest.mark.parametrize(
    "name", [*PUBLISHED, "deepseek-v2-lite", "glm-4.5-air", "phi-3.5-moe", "gpt-oss-20b"]
)
def test_made_checkpoint_loads_in_both_and_agrees(capsys, tmp_path, name):
    """Written at --shrink 16: transformers loads it, and our greedy tokens equal its own."""
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
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == shrunk(SHAPES[name], 16).checkpoint_bytes(2, 4)
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
    assert len(set(ref)) > 1  # not one token repeated
    if name == "gpt-oss-20b":
        assert json.loads((out / "config.json").read_text())["layer_types"] == [
            "sliding_attention",
            "full_attention",
        ]
    with LLMEngine.from_pretrained(
        out, RuntimeConfig(buffer_slots=2, max_model_len=64, max_batch_size=1)
    ) as eng:
        assert eng.tokenizer.encode(PROMPT) == prompt
        assert _greedy(eng, prompt, 12) == ref


def test_bytes_do_not_depend_on_the_cores(tmp_path, monkeypatch):
    """The draws run chunked on every core (``dummy_weights.CHUNK``, one generator a chunk): one core and
    this host's cores write the same shards, and a tensor's chunks are not copies of each other."""
    from safetensors.torch import load_file

    import moe_runtime.dummy_weights as dummy
    import moeserve.checkpoints.writer as writer

    monkeypatch.setattr(dummy, "CHUNK", 1 << 14)  # several chunks a tensor at the shrunk widths
    real = shrunk(SHAPES["qwen3-30b-a3b"], 16)
    writer.write_checkpoint(real, 1, tmp_path / "many", seed=3)
    monkeypatch.setattr(writer.os, "cpu_count", lambda: 1)
    writer.write_checkpoint(real, 1, tmp_path / "one", seed=3)
    shards = sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    assert len(shards) == 2
    for name in shards:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "many" / name).read_bytes(), name
    embed = load_file(tmp_path / "one" / shards[0])["model.embed_tokens.weight"].flatten()
    assert embed.numel() > 2 * dummy.CHUNK
    assert not torch.equal(embed[: dummy.CHUNK], embed[dummy.CHUNK : 2 * dummy.CHUNK])


def test_routing_is_input_dependent(tmp_path):
    from moeserve.checkpoints.writer import write_checkpoint

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
        (["--shape", "deepseek-v3", "--layers", "3"], "first 3 layers are dense"),
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
