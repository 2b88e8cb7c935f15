"""Router lookahead: the folded routers equal norm-then-route, it never changes outputs, it feeds
the ``eam`` plan of the next layers only, and bad settings are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_runtime.config import RuntimeConfig
from moe_runtime.errors import ConfigError
from moe_runtime.layers.norm import rms_norm
from moe_runtime.layers.router_lookahead import RouterLookahead


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_scores_equal_each_later_layers_norm_and_router(tiny_checkpoints, family):
    from moe_runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_checkpoints[family], RuntimeConfig())
    cfg, dense = loaded.config, loaded.dense
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    la = RouterLookahead(cfg, dense, depth=4)
    got = la.scores(x, 0)
    later = cfg.moe_layers[1:]
    assert got.shape == (len(later), cfg.num_experts)
    for d, layer in enumerate(later):
        h = rms_norm(x, dense[f"layers.{layer}.mlp_norm"], cfg.rms_norm_eps)
        want = F.softmax(F.linear(h, dense[f"layers.{layer}.router"]).float(), dim=-1).sum(0)
        torch.testing.assert_close(got[d], want, rtol=1e-5, atol=1e-5)
    assert la.scores(x, cfg.num_moe_layers - 1) is None  # nothing after the last MoE layer


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_scores_from_the_attention_norms_output_are_the_same_in_fewer_ops(tiny_checkpoints, family):
    """Handed the decoder layer's attention-norm output (as the model does), the lookahead runs
    one matmul on routers with that norm's weight divided out: the scores of normalising the
    residual itself, with 4 aten ops per call instead of 11 (a CPU proxy for kernel launches)."""
    from moe_runtime.loader import load_checkpoint
    from tests.test_op_counts import _Count

    loaded = load_checkpoint(tiny_checkpoints[family], RuntimeConfig())
    cfg, dense = loaded.config, dict(loaded.dense)
    gen = torch.Generator().manual_seed(1)
    for layer in cfg.moe_layers:  # norm weights other than the checkpoints' ones, of either sign
        for name in ("attn_norm", "mlp_norm"):
            w = dense[f"layers.{layer}.{name}"]
            sign = torch.where(torch.rand(w.shape, generator=gen) < 0.2, -1.0, 1.0)
            dense[f"layers.{layer}.{name}"] = (sign * (0.5 + torch.rand(w.shape, generator=gen))).to(w.dtype)
    x = torch.randn(5, cfg.hidden_size, generator=gen) * 3
    la = RouterLookahead(cfg, dense, depth=2)
    for i, layer in enumerate(cfg.moe_layers[:-1]):
        normed = rms_norm(x, dense[f"layers.{layer}.attn_norm"], cfg.rms_norm_eps)
        with _Count() as plain:
            want = la.scores(x, i)
        with _Count() as folded:
            got = la.scores(x, i, normed=normed)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert (plain.ops, folded.ops) == (11, 4)
    last = cfg.num_moe_layers - 1
    assert la.scores(x, last, normed=x) is None  # nothing after the last MoE layer


def test_depth_must_be_positive(tiny_qwen3):
    from moe_runtime.loader import load_checkpoint

    loaded = load_checkpoint(tiny_qwen3, RuntimeConfig())
    with pytest.raises(ValueError, match="depth"):
        RouterLookahead(loaded.config, loaded.dense, 0)
    with pytest.raises(ConfigError, match="--router-lookahead"):
        RuntimeConfig(router_lookahead=-1)


def _generate(path, lookahead, slots):
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams

    rt = RuntimeConfig(buffer_slots=slots, max_batch_size=2, max_model_len=64, router_lookahead=lookahead)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLMEngine.from_pretrained(path, rt) as engine:
        seen = []
        observe = getattr(engine.prefetcher, "observe_lookahead", None)
        if observe is not None:

            def spy(layer, scores):
                seen.append((layer, scores.copy()))
                observe(layer, scores)

            engine.prefetcher.observe_lookahead = spy
        outs = [o.output_token_ids for o in engine.generate([[5, 17, 33, 2], [9, 1, 44, 3, 3]], params)]
        return outs, seen, engine.model.lookahead


def test_lookahead_never_changes_outputs_and_reaches_the_policy(tiny_qwen3):
    ref, _, _ = _generate(tiny_qwen3, 0, 16)  # all resident: 2 layers x 8 experts
    off, seen_off, la_off = _generate(tiny_qwen3, 0, 2)
    on, seen_on, la_on = _generate(tiny_qwen3, 1, 2)
    assert off == ref and on == ref
    assert la_off is None and not seen_off
    assert la_on is not None and seen_on
    assert {layer for layer, _ in seen_on} == {0}  # the last MoE layer has nothing to look ahead to
    assert all(s.shape == (1, 8) and s.min() >= 0 for _, s in seen_on)


def test_blend_moves_only_the_next_layers_toward_the_guess():
    from test_policies import fake_eam_policy, small_store

    from moe_runtime.buffer import ExpertBuffer

    layers, experts = 4, 5
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        eam = np.ones((layers, experts))
        # the EAMC plans all later layers, the lookahead only the next one
        pol = fake_eam_policy(buf, eam, lookahead=1, depth=layers)
        base = pol.predict(0, ["r"])
        guess = np.array([[0, 0, 0, 3.0, 0], [5.0, 0, 0, 0, 0]])  # layers 1 and 2
        pol.observe_lookahead(0, guess)
        blended = pol.blend_lookahead(0, base)
        np.testing.assert_allclose(blended.sum(axis=1)[1:], 1.0, rtol=1e-6)
        assert blended[1].argmax() == 3 and blended[1, 3] > base[1, 3]  # depth 1: layer 1 only
        np.testing.assert_allclose(blended[2:], base[2:])
        pol.observe_lookahead(2, guess)  # scores of another layer are ignored
        np.testing.assert_allclose(pol.blend_lookahead(0, base), base)
        np.testing.assert_allclose(pol.blend_lookahead(0, base), base)  # consumed once
    finally:
        buf.close()


def test_lookahead_alone_sets_the_plan_depth():
    from test_policies import fake_eam_policy, small_store

    from moe_runtime.buffer import ExpertBuffer

    layers, experts = 4, 5
    buf = ExpertBuffer(small_store(), [torch.device("cpu")], 12, link=(1e-7, 0.0))
    try:
        eam = np.ones((layers, experts))
        assert fake_eam_policy(buf, eam, lookahead=2).depth == 2
        assert fake_eam_policy(buf, eam, lookahead=2, depth=3).depth == 3
        assert fake_eam_policy(buf, eam, lookahead=0).depth == layers  # the paper's plan
        pol = fake_eam_policy(buf, eam, lookahead=1)
        pol.observe_lookahead(0, np.array([[0, 0, 9.0, 0, 0], [1.0, 0, 0, 0, 0]]))
        pol.after_routing(0, ["r"], np.zeros((1, 2), dtype=np.int64))
        assert pol.last_probs[1].argmax() == 2
        assert not pol.last_probs[2:].any()  # nothing planned beyond the lookahead
    finally:
        buf.close()


def test_bench_lookahead_beats_chance_on_the_bundled_model(shared_data, capsys):
    import json

    from moeserve.cli import main

    prompts = shared_data / "prompts" / "prompts_combined.jsonl"
    args = ["bench", "lookahead", "--prompts", str(prompts), "--tasks", "2", "--warm", "1", "--eval", "1"]
    assert main([*args, "--new-tokens", "6", "--depth", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["results"]
    assert [r["distance"] for r in rows] == [1, 2] and all(r["n"] > 0 for r in rows)
    assert rows[0]["topk_precision"] > 3 * doc["settings"]["chance_precision"]  # 0.0625 on 64 experts
    assert all(r["top2k_recall"] >= r["topk_precision"] for r in rows)
