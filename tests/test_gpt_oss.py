"""gpt-oss against transformers' own GptOssForCausalLM (the oracle).

A tiny checkpoint with non-default settings (``tests/tiny_models.py``: sliding window 4, shorter
than the prompts, layers alternating sliding and full attention, 6 experts top-2, random attention
sinks and router/expert biases, YaRN RoPE without truncation, a SwiGLU clamp that bites): greedy
tokens equal and fp32 logits within 1e-4 at every step for 32 new tokens, for one prompt and a
batch of four prompts of different lengths, every expert resident and at a 2-slot buffer; chunked
prefill and a request joining mid-decode; prompts 4-5x the window (whole, in chunks shorter and
longer than the window); the grouped, loop and few expert paths bit-identical. Kernel level:
sinks by SDPA's log-sum-exp and by a padded key, and sliding layers over their KV ring (chunks,
decodes, a mixed step of different lengths) equal transformers' eager attention; the ring plan
and float masks are built once per step, not per layer; a sliding layer's KV rows hold the window.
Also: removing any gpt-oss piece (sinks, window, biases, clamp) moves the logits far beyond the
tolerance, so the comparisons above depend on each; the RoPE tables and the router equal
transformers'; the memory plan counts the new dense tensors; bad config fields are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_experts import _logits
from test_runtime_oracle import (
    _run_collecting_logits,
    assert_matches,
    check_buffer_stats,
    greedy_references,
    join_mid_decode,
)
from tiny_models import make_gpt_oss_checkpoint

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.context import StepContext
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from moe_runtime.errors import CheckpointError, ConfigError
from moe_runtime.layers import attention
from moe_runtime.layers.kv_cache import KVCache
from moe_runtime.layers.norm import rms_norm
from moe_runtime.layers.rotary import Rotary
from moe_runtime.layers.router_lookahead import RouterLookahead
from moe_runtime.layers.routing import route
from moe_runtime.loader import read_model_config
from moe_runtime.memory_plan import plan_memory

PROMPTS = [[5, 17, 33, 2, 250, 7], [9, 1, 44], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109], [77]]
NEW = 32
ATOL = 1e-4
RUNTIME = dict(max_model_len=64, max_batch_size=4)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(checkpoint folder, transformers model, [(tokens, step logits [NEW, V])] per prompt)."""
    path = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "tiny")
    return (path, *greedy_references(path, PROMPTS, NEW))


@pytest.mark.parametrize("slots", [None, 2], ids=["all-resident", "2-slots"])
def test_greedy_tokens_and_logits_match_transformers(gpt_oss, slots):
    path, _, refs = gpt_oss
    with LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=slots, **RUNTIME)) as engine:
        single = _run_collecting_logits(engine, PROMPTS[:1], GREEDY)
        batch = _run_collecting_logits(engine, PROMPTS, GREEDY)
        stats = engine.buffer.stats
        lookahead = engine.model.lookahead
    assert_matches(single + batch, refs[:1] + refs)
    check_buffer_stats(stats, slots)
    assert (lookahead is not None) == (slots == 2)  # the eam prefetch (offloading only) ran it


def test_chunked_prefill_and_mixed_steps(gpt_oss):
    """Prompts prefilled in chunks of 3 tokens (a chunk's window reaches into the cached past) and
    a request joining while another decodes still give transformers' tokens."""
    path, _, refs = gpt_oss
    runtime = RuntimeConfig(buffer_slots=3, max_num_batched_tokens=3, **RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        finals = join_mid_decode(engine, PROMPTS[2], PROMPTS[0], GREEDY)
    assert finals == {"a": refs[2][0], "b": refs[0][0]}


LONG = [
    [(7 * i + 3) % 300 for i in range(22)],
    [(11 * i + 5) % 300 for i in range(17)],
]  # 5.5 and 4.25 windows


@pytest.fixture(scope="module")
def long_refs(gpt_oss):
    """transformers' greedy tokens and step logits for :data:`LONG`, 12 new tokens each."""
    return greedy_references(gpt_oss[0], LONG, 12)[1]


@pytest.mark.parametrize("chunk", [None, 3, 9], ids=["whole", "chunks-3", "chunks-9"])
def test_prompts_several_windows_long(gpt_oss, long_refs, chunk):
    """Prompts 4-5x the window (the sliding layers' KV rings wrap several times), prefilled whole or
    in chunks shorter and longer than the window, then decoded as a batch of two different lengths,
    give transformers' tokens and logits; the sliding layers' KV rows hold the window only."""
    runtime = RuntimeConfig(buffer_slots=2, max_num_batched_tokens=chunk or 64, **RUNTIME)
    with LLMEngine.from_pretrained(gpt_oss[0], runtime) as engine:
        results = _run_collecting_logits(
            engine, LONG, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
        kv, cfg, summary = engine.kv, engine.config, engine.summary()
    assert_matches(results, long_refs)
    assert "(2 sliding layers hold 4 positions)" in summary
    assert [kv.k[i].shape[2] for i in range(cfg.num_layers)] == [4, 64, 4]  # window, max_model_len, window


def test_padded_prefill_of_two_prompts(gpt_oss):
    """Two prompts of similar length prefill in one padded SDPA (windowed, with sinks): tokens and
    logits still equal transformers'."""
    path, _, refs = gpt_oss
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with (
        mock.patch.object(attention, "_prefill_padded", wraps=attention._prefill_padded) as padded,
        mock.patch.object(attention, "_ring_group", wraps=attention._ring_group) as ring_group,
        LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine,
    ):
        results = _run_collecting_logits(engine, [PROMPTS[0], PROMPTS[2]], params)
    cfg = engine.config
    assert padded.call_count == cfg.num_layers - len(cfg.sliding_layers)  # the prefill step, full layers
    assert ring_group.call_args_list[0].args[1] == [0, 1]  # both chunks in one group over the rings
    assert_matches(results, [(tokens[:8], logits[:8]) for tokens, logits in (refs[0], refs[2])])


def test_expert_paths_bit_identical(gpt_oss):
    """The per-expert biases and the clamped SwiGLU give the same bits on the grouped, loop and
    few paths, resident and at a 2-slot buffer."""
    path = gpt_oss[0]
    ref = _logits(path, "loop")
    assert torch.equal(_logits(path, "grouped"), ref)
    assert torch.equal(_logits(path, "grouped", buffer_slots=2), ref)
    assert torch.equal(_logits(path, "grouped", few_tokens=3, buffer_slots=2), ref)


def _without(engine, piece: str) -> None:
    """Switch one gpt-oss piece off in a loaded engine's model."""
    model = engine.model
    if piece == "sinks":
        for layer in range(engine.config.num_layers):
            model.w.pop(f"layers.{layer}.sinks")
    elif piece == "window":  # full-length KV rows for every layer: no ring, no window
        cfg, kv = engine.config, model.kv
        model.kv = KVCache(
            cfg.num_layers, kv.rows, cfg.num_kv_heads, kv.max_len, cfg.head_dim, torch.float32, kv.k[1].device
        )
    elif piece == "expert biases":
        model.ffn = {
            k: dataclasses.replace(f, gate_up_bias=None, down_bias=None) for k, f in model.ffn.items()
        }
    elif piece == "clamp":
        act = dataclasses.replace(engine.config.expert_act, limit=1e9)
        model.ffn = {k: dataclasses.replace(f, act=act) for k, f in model.ffn.items()}
    else:  # router bias
        for layer in engine.config.moe_layers:
            model.w.pop(f"layers.{layer}.router_logit_bias")


@pytest.mark.parametrize("piece", ["sinks", "window", "expert biases", "clamp", "router bias"])
def test_prefill_logits_need_each_piece(gpt_oss, piece):
    """Prefill logits of a 42-token sequence at a 2-slot buffer equal transformers' forward; without
    the piece they are far from it (so the tests above, at 1e-4, check it)."""
    path, model, refs = gpt_oss
    seq = PROMPTS[2] + refs[2][0]
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(buffer_slots=2, **RUNTIME)) as engine:
        torch.testing.assert_close(engine.prefill_logits(seq), want, atol=ATOL, rtol=0)
        _without(engine, piece)
        assert (engine.prefill_logits(seq) - want).abs().max() > 100 * ATOL


def test_rotary_equals_transformers(gpt_oss):
    """The YaRN cos/sin tables (``truncate: false``) rotate q and k exactly as transformers does."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    path, model, _ = gpt_oss
    _, cfg, _ = read_model_config(path)
    assert cfg.yarn is not None and not cfg.yarn.truncate and cfg.rope_theta == 150000.0
    ours = Rotary(cfg.head_dim, cfg.rope_theta, 64, torch.float32, torch.device("cpu"), yarn=cfg.yarn)
    positions = torch.arange(0, 64, 3)
    q = torch.randn(1, 4, len(positions), 16, generator=torch.Generator().manual_seed(1))
    k = torch.randn(1, 2, len(positions), 16, generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ours.apply(q[0].transpose(0, 1), k[0].transpose(0, 1), positions)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def _eager(q, k, v, sinks, visible):
    """transformers' ``eager_attention_forward`` (GQA 4:2, head dim 16) under a boolean mask
    ``[Lq, C]``: ``[1, Lq, Hq, D]``."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    return eager_attention_forward(module, q, k, v, mask, scaling=16**-0.5)[0]


def _qkv_sinks(n: int, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h in (4, 2, 2))
    return q, k, v, torch.randn(4, generator=gen)


@pytest.mark.parametrize("route", ["log-sum-exp", "padding"])
def test_sinks_equal_transformers_eager(route):
    """Sinks from SDPA's log-sum-exp (CPU) and as an extra padded key (where no log-sum-exp is
    returned) both equal transformers' eager attention: 5 new queries after 4 cached keys."""
    q, k, v, sinks = _qkv_sinks(9)
    q = q[:, :, 4:]
    prefix = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # the step's causal mask
    want = _eager(q, k, v, sinks, prefix)
    if route == "padding":
        got = attention._sinks_by_padding(q, k, v, prefix, sinks)
    else:
        got = attention._sinks_by_lse(q, k, v, attention._additive(prefix, q.dtype), sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunks", [(4, 5), (9, 3), (2, 1, 1, 5, 1, 1, 1), (12,)])
def test_ring_attention_equals_transformers_eager(chunks):
    """A window-3 layer over its 3-position KV ring, the tokens fed in the given chunks (longer
    than the window, single decodes), with sinks, equals transformers' eager attention with its
    mask rule (``q - window < kv <= q``) over every key."""
    total = sum(chunks)
    q, k, v, sinks = _qkv_sinks(total)
    cache = KVCache(1, 2, 2, 32, 16, torch.float32, torch.device("cpu"), windows={0: 3})
    assert cache.k[0].shape == (2, 2, 3, 16) and cache.nbytes == 2 * 2 * 2 * 3 * 16 * 4
    outs, past = [], 0
    for n in chunks:
        step = StepContext.build(["a"], [1], [past], [n], [True], torch.device("cpu"))
        part = (x[0, :, past : past + n].transpose(0, 1) for x in (q, k, v))
        outs.append(attention.attention(*part, 0, cache, step, sinks))
        past += n
    pos, kv = torch.arange(total)[:, None], torch.arange(total)[None, :]
    want = _eager(q, k, v, sinks, (kv <= pos) & (kv > pos - 3))
    torch.testing.assert_close(torch.cat(outs), want.reshape(total, -1), atol=1e-6, rtol=0)


def test_ring_mixed_step_and_masks_built_once_per_step(monkeypatch):
    """One step mixing decodes of different lengths with two prefill chunks (one padded call),
    over window-4 rings, equals transformers' eager attention per sequence; the step's ring plan
    and its float masks are built once for all of its layers."""
    cpu = torch.device("cpu")
    window, layers = 4, 6  # even layers slide
    cache = KVCache(
        layers, 4, 2, 32, 16, torch.float32, cpu, windows={i: window for i in range(0, layers, 2)}
    )
    rows, past, new = [2, 0, 3, 1], [9, 5, 0, 3], [1, 6, 7, 1]
    total = [p + n for p, n in zip(past, new)]
    seqs = [_qkv_sinks(t, seed=10 + i) for i, t in enumerate(total)]
    sinks = seqs[0][3]
    pre = [i for i in range(4) if past[i]]  # their history, prefilled through the rings
    step = StepContext.build(
        ["h"] * len(pre),
        [rows[i] for i in pre],
        [0] * len(pre),
        [past[i] for i in pre],
        [True] * len(pre),
        cpu,
    )
    hist = [torch.cat([seqs[i][j][0, :, : past[i]].transpose(0, 1) for i in pre]) for j in range(3)]
    for layer in range(layers):
        attention.attention(*hist, layer, cache, step, sinks)
    plans = mock.MagicMock(wraps=attention._ring_plan)
    masks = mock.MagicMock(wraps=attention._additive)
    monkeypatch.setattr(attention, "_ring_plan", plans)
    monkeypatch.setattr(attention, "_additive", masks)
    step = StepContext.build(list("abcd"), rows, past, new, [True] * 4, cpu)
    assert step.prefill_mask is not None  # the two chunks share one padded call
    now = [torch.cat([seqs[i][j][0, :, past[i] :].transpose(0, 1) for i in range(4)]) for j in range(3)]
    outs = [attention.attention(*now, layer, cache, step, sinks) for layer in range(layers)]
    assert plans.call_count == 1  # one window: one plan for the three sliding layers
    assert masks.call_count == 4  # decodes and prefills: once on the rings, once on full rows
    for layer, out in enumerate(outs):
        for i in range(4):
            q, k, v, _ = seqs[i]
            pos, kv = torch.arange(past[i], total[i])[:, None], torch.arange(total[i])[None, :]
            visible = (kv <= pos) & ((kv > pos - window) if layer % 2 == 0 else True)
            want = _eager(q[:, :, past[i] :], k, v, sinks, visible).reshape(new[i], -1)
            a = step.starts[i]
            torch.testing.assert_close(out[a : a + new[i]], want, atol=1e-6, rtol=0)


def test_router_and_lookahead_match_transformers(gpt_oss):
    """route() picks transformers' experts with its weights on 256 tokens; the router lookahead's
    logits for layer 1 equal layer 1's biased router on the normed residual."""
    path, model, _ = gpt_oss
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        cfg, w = engine.config, engine.model.w
        router = model.model.layers[1].mlp.router
        x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            _, ref_w, ref_ids = router(x)
        weights, ids = route(x, w["layers.1.router"], cfg, None, w["layers.1.router_logit_bias"])
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=0)
        ahead = RouterLookahead(cfg, w, 1).logits(x, 0)[:, 0]
        want = F.linear(rms_norm(x, w["layers.1.mlp_norm"], cfg.rms_norm_eps), router.weight, router.bias)
        torch.testing.assert_close(ahead, want, atol=1e-5, rtol=0)


def test_lookahead_from_the_attention_norm_keeps_the_router_bias(gpt_oss):
    """The router lookahead handed the attention norm's output (the model's path) adds the later
    routers' biases as the residual's own normalisation does: the same scores."""
    path = gpt_oss[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(**RUNTIME)) as engine:
        cfg, w = engine.config, engine.model.w
        la = RouterLookahead(cfg, w, 1)
        x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
        normed = rms_norm(x, w[f"layers.{cfg.moe_layers[0]}.attn_norm"], cfg.rms_norm_eps)
        assert la.attn_folded[0] is not None and la.biases is not None
        torch.testing.assert_close(la.scores(x, 0, normed=normed), la.scores(x, 0), rtol=1e-4, atol=1e-4)


def test_memory_plan_counts_the_new_dense_tensors(gpt_oss):
    """Sinks, the o bias, the router bias and the expert biases are dense weights the plan counts:
    its dense bytes equal what the loader put on the device."""
    path = gpt_oss[0]
    runtime = RuntimeConfig(**RUNTIME)
    with LLMEngine.from_pretrained(path, runtime) as engine:
        dense = engine.loaded.dense
        assert dense["layers.0.sinks"].shape == (4,) and dense["layers.2.expert_gate_up_bias"].shape == (
            6,
            96,
        )
        plan = plan_memory(engine.config, runtime)
        assert plan.dense == engine.loaded.dense_nbytes and plan.kv_cache == engine.kv.nbytes


def test_bf16_runs(gpt_oss):
    """bf16 weights and activations through the sink mask and the biased experts: finite logits."""
    path = gpt_oss[0]
    with LLMEngine.from_pretrained(path, RuntimeConfig(dtype="bf16", buffer_slots=2, **RUNTIME)) as engine:
        ((tokens, logits),) = _run_collecting_logits(
            engine, PROMPTS[2:3], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    assert len(tokens) == 4 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention", "local", "full_attention"]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quant_method"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_parameters.rope_type"),
    ],
)
def test_bad_config_fields_are_named(gpt_oss, tmp_path, change, field):
    shutil.copy(gpt_oss[0] / "config.json", tmp_path / "config.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field):
        read_model_config(tmp_path)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("model.layers.1.mlp.experts.gate_up_proj", "transpose", "gate_up_proj: expected shape"),
        ("model.layers.0.self_attn.sinks", "drop", "missing tensor model.layers.0.self_attn.sinks"),
        ("model.layers.2.mlp.experts.down_proj_bias", "drop", "missing tensor .*down_proj_bias"),
    ],
)
def test_bad_tensors_are_named(gpt_oss, tmp_path, name, change, message):
    """A fused expert tensor in the wrong orientation or a missing sink / expert-bias tensor is
    refused, naming the checkpoint tensor."""
    from safetensors.torch import load_file, save_file

    src = gpt_oss[0]
    tensors = load_file(str(src / "model.safetensors"))
    if change == "drop":
        del tensors[name]
    else:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=message):
        LLMEngine.from_pretrained(tmp_path, RuntimeConfig(**RUNTIME))


GPT_OSS_20B = {  # gpt-oss-20b's config.json (the fields we read), without its quantization_config
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "rms_norm_eps": 1e-05,
    "vocab_size": 201088,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "tie_word_embeddings": False,
}


def test_released_config_parses(tmp_path):
    """gpt-oss-20b's own config format (``rope_scaling`` + ``rope_theta``): every layer MoE, even
    layers sliding, YaRN without truncation, the default SwiGLU alpha."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    _, cfg, _ = read_model_config(tmp_path)
    assert cfg.moe_layers == list(range(24)) and cfg.sliding_layers == list(range(0, 24, 2))
    assert cfg.sliding_window == 128 and cfg.num_experts == 32 and cfg.top_k == 4
    assert cfg.yarn.factor == 32 and cfg.yarn.original_max_position_embeddings == 4096
    assert not cfg.yarn.truncate and cfg.rope_theta == 150000
    assert cfg.expert_act.alpha == 1.702 and cfg.expert_act.limit == 7.0
    assert cfg.o_bias and cfg.attention_sinks and cfg.router_logit_bias and cfg.expert_bias


def test_kv_plan_of_20b_holds_windows_only(tmp_path):
    """At gpt-oss-20b's shape and 4096 tokens, the 12 sliding layers' KV rows hold 128 positions:
    the planned KV cache is 12 x 4096 + 12 x 128 token-layers, about half of full-length rows."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    _, cfg, _ = read_model_config(tmp_path)
    plan = plan_memory(cfg, RuntimeConfig(max_model_len=4096, max_batch_size=2, dtype="bf16"))
    per_token_layer = 2 * 8 * 64 * 2  # K and V, 8 KV heads x 64 dims, bf16
    assert plan.kv_cache == 2 * (12 * 4096 + 12 * 128) * per_token_layer
    assert 0.51 < plan.kv_cache / (2 * 24 * 4096 * per_token_layer) < 0.52
