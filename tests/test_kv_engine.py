"""The paged KV cache in the engine: preemption by recompute and prefix caching give the tokens a
run without them gives, the expert trace stays whole, for GQA, latent attention (DeepSeek) and
sliding windows (gpt-oss).

* A pool of a few blocks forces preemptions mid-decode: greedy and seeded-sampled requests finish
  with the tokens of a roomy pool, their streamed tokens and text add up to the final output with
  nothing repeated or missing, and each request's EAM (prefill and decode counts) equals the
  roomy run's (recomputed tokens are not counted twice).
* Requests sharing a prefix, one after another: the later ones report ``num_cached_tokens``,
  their tokens equal a run with prefix caching off and their logits stay within 1e-4, and their
  EAMs equal the uncached run's (credited from the blocks' stored counts).
* Prompt logprobs skip the cache and are not scored twice after a preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import make_deepseek_checkpoint, make_gpt_oss_checkpoint

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams
from tracer.eamc import EAMC
from tracer.recorder import RequestRecorder

PROMPTS = [[(7 * i + 3 * j) % 300 + 1 for i in range(9 + 6 * j)] for j in range(4)]
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, top_p=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.7, top_k=5, seed=5, ignore_eos=True),
]


class KeepingRecorder(RequestRecorder):
    """A recorder that keeps each finished request's EAM (prefill, decode) counts."""

    def __init__(self, cfg) -> None:
        eamc = EAMC(cfg.num_moe_layers, cfg.num_experts)
        super().__init__(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, eamc=eamc)
        self.eams: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def finish(self, request_id: str) -> None:
        self.end_step()
        self.eams[request_id] = self.request_eam(request_id)
        super().finish(request_id)


def paged_checkpoints(tiny_checkpoints, root) -> dict:
    """The three attention kinds of the paged cache: GQA (Qwen3), latent (DeepSeek-V3), sliding
    windows with sinks (gpt-oss)."""
    return {
        "qwen3_moe": tiny_checkpoints["qwen3_moe"],
        "deepseek": make_deepseek_checkpoint("v3", root / "v3"),
        "gpt_oss": make_gpt_oss_checkpoint(root / "gpt_oss"),
    }


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    return paged_checkpoints(tiny_checkpoints, tmp_path_factory.mktemp("paged"))


def _run(path, runtime: RuntimeConfig, prompts, params, one_by_one=False):
    """Per request: (output tokens, streamed tokens, streamed text, final text, EAM, cached tokens);
    the engine's stats."""
    from moe_runtime.loader import load_checkpoint

    loaded = load_checkpoint(path, runtime)
    recorder = KeepingRecorder(loaded.config)
    with LLMEngine(loaded, runtime, recorder=recorder) as engine:
        streamed = {f"r{i}": ([], []) for i in range(len(prompts))}
        finals = {}
        waves = [[i] for i in range(len(prompts))] if one_by_one else [list(range(len(prompts)))]
        for wave in waves:
            for i in wave:
                engine.add_request(f"r{i}", prompts[i], params[i])
            while engine.has_unfinished():
                for out in engine.step():
                    streamed[out.request_id][0].extend(out.new_token_ids)
                    streamed[out.request_id][1].append(out.new_text)
                    if out.finished:
                        finals[out.request_id] = out
        stats = engine.stats
        assert engine.kv_manager.num_free == engine.kv_manager.num_blocks  # every block back
    result = {
        rid: (out.output_token_ids, streamed[rid][0], "".join(streamed[rid][1]), out.text, recorder.eams[rid])
        for rid, out in finals.items()
    }
    cached = {rid: out.num_cached_tokens for rid, out in finals.items()}
    return result, cached, stats


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        tokens, streamed, text, final_text, (pre, dec) = a[rid]
        assert tokens == b[rid][0], rid
        assert streamed == tokens and text == final_text == b[rid][3]  # no token repeated or lost
        np.testing.assert_array_equal(pre, b[rid][4][0])
        np.testing.assert_array_equal(dec, b[rid][4][1])


@pytest.mark.parametrize(
    "family, blocks",
    [("qwen3_moe", 14), ("deepseek", 14), ("gpt_oss", 20)],
    ids=["gqa", "mla", "sliding"],
)
def test_preempted_requests_finish_with_the_same_tokens(checkpoints, family, blocks):
    base = dict(max_model_len=48, max_batch_size=4, block_size=4, buffer_slots=2, max_num_batched_tokens=16)
    roomy, _, _ = _run(checkpoints[family], RuntimeConfig(**base), PROMPTS, PARAMS)
    tight, _, stats = _run(checkpoints[family], RuntimeConfig(num_kv_blocks=blocks, **base), PROMPTS, PARAMS)
    assert stats.preemptions >= 2
    _same(tight, roomy)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek", "gpt_oss"], ids=["gqa", "mla", "sliding"])
def test_prefix_cache_hits_equal_runs_without_it(checkpoints, family):
    """Four requests sharing a 21-token prefix (5 blocks of 4), one after another."""
    shared = PROMPTS[3][:21]
    prompts = [shared + [5 + i, 9, 2 * i + 1] for i in range(4)]
    params = [PARAMS[0], PARAMS[1], PARAMS[0], PARAMS[2]]
    base = dict(max_model_len=64, max_batch_size=4, block_size=4, buffer_slots=2)
    off, cached_off, _ = _run(
        checkpoints[family], RuntimeConfig(enable_prefix_caching=False, **base), prompts, params, True
    )
    on, cached_on, stats = _run(checkpoints[family], RuntimeConfig(**base), prompts, params, True)
    assert cached_off == {f"r{i}": 0 for i in range(4)}
    assert cached_on == {"r0": 0, "r1": 20, "r2": 20, "r3": 20}
    assert stats.prefix_cache_hits == 60 and stats.prefix_cache_queries == 4 * 24
    _same(on, off)


def test_hit_logits_stay_within_tolerance(tiny_qwen3):
    """A request served from cached blocks gives the logits of a full prefill (1e-4), and a
    prompt spanning several blocks at size 4 equals the same at size 16."""
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    logits = {}
    for name, runtime in {
        "b16-off": RuntimeConfig(max_model_len=64, enable_prefix_caching=False),
        "b4": RuntimeConfig(max_model_len=64, block_size=4),
    }.items():
        with LLMEngine.from_pretrained(tiny_qwen3, runtime) as engine:
            rows = []
            for _ in range(2):  # the second run hits the first's blocks (caching on)
                engine.add_request(f"x{len(rows)}", prompt, params)
                while engine.has_unfinished():
                    if engine.step():
                        rows.append(engine.last_logits[0].clone())
            logits[name] = torch.stack(rows)
    torch.testing.assert_close(logits["b4"], logits["b16-off"], atol=1e-4, rtol=0)


def test_prompt_logprobs_skip_the_cache_and_survive_preemption(tiny_qwen3):
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    ]
    prompts = [PROMPTS[2], PROMPTS[2]]
    out = {}
    for blocks in (None, 11):
        runtime = RuntimeConfig(max_model_len=40, block_size=4, num_kv_blocks=blocks)
        with LLMEngine.from_pretrained(tiny_qwen3, runtime) as engine:
            finals = engine.generate(prompts, params)
            out[blocks] = finals
            preempted = engine.stats.preemptions
    assert preempted >= 1
    for a, b in zip(out[None], out[11]):
        assert a.output_token_ids == b.output_token_ids
    first = out[11][0].prompt_logprobs
    assert len(first) == len(prompts[0]) and first[0] is None
    assert [lp.token_id for lp in first[1:]] == prompts[0][1:]
    assert [lp.logprob for lp in first[1:]] == pytest.approx(
        [lp.logprob for lp in out[None][0].prompt_logprobs[1:]]
    )
    assert out[11][0].num_cached_tokens == 0


def test_scoring_borrows_blocks_and_returns_them(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_model_len=64, block_size=4)) as engine:
        got = engine.prefill_logits(PROMPTS[1])
        assert got.shape == (len(PROMPTS[1]), engine.config.vocab_size)
        assert engine.kv_manager.num_free == engine.kv_manager.num_blocks
        assert engine.kv_manager.pool.num_cached == 0  # scratch blocks are not cached
