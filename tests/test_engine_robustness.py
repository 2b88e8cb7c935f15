"""Engine robustness: a numerically safe per-row sampler, per-request failure isolation, and
incremental detokenising that matches decoding the whole output."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine import outputs as outputs_module
from moe_runtime.engine.detokenizer import finish_text, take_delta, update_text
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import SamplingParams, Sequence
from moe_runtime.engine.sampler import Sampled, SamplingError, sample
from moe_runtime.errors import RequestError
from moe_runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with LLMEngine.from_pretrained(tiny_qwen3, RuntimeConfig(max_model_len=64, max_batch_size=4)) as eng:
        yield eng


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, **kw)


@pytest.mark.parametrize("temperature", [1e-40, 1e-39, 1e-300, 5e-324, 9.9e-6])
def test_tiny_temperature_is_greedy(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    picks = sample(logits, [_params(temperature=temperature)] * 3, [torch.Generator()] * 3)
    assert [p.token for p in picks] == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    params = [_params(temperature=1.0, top_p=1e-300, logprobs=2)] * 2
    picks = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(2)])
    assert [p.token for p in picks] == logits.argmax(-1).tolist()
    assert all(math.isfinite(p.logprob.logprob) for p in picks)


def test_a_bad_row_fails_alone_and_logprobs_stay_finite():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    logits[1, 5] = float("nan")
    logits[2, :10] = float("-inf")  # masked tokens: logprobs -inf are clamped, not sent as -inf
    params = [
        _params(temperature=0.8, logprobs=15),
        _params(temperature=0.8),
        _params(temperature=0, logprobs=15),
    ]
    picks = sample(logits, params, [torch.Generator().manual_seed(3)] * 3)
    assert isinstance(picks[0], Sampled) and isinstance(picks[2], Sampled)
    assert isinstance(picks[1], SamplingError)
    assert min(picks[2].logprob.top.values()) == -9999.0


@pytest.mark.parametrize("bad", [{"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}])
def test_sampling_params_refuse_non_finite_values(bad):
    with pytest.raises(RequestError):
        _params(**bad)


def test_a_failing_request_finishes_with_error_and_the_others_run_on(engine, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [o.output_token_ids for o in engine.generate([[3, 4, 5], [9, 8]], params)]
    real = outputs_module.update_text

    def update_text_failing_for_one(seq, tokenizer):
        if seq.request_id == "bad" and len(seq.output_token_ids) == 2:
            raise ValueError("injected")
        return real(seq, tokenizer)

    monkeypatch.setattr(outputs_module, "update_text", update_text_failing_for_one)
    for rid, prompt in [("a", [3, 4, 5]), ("bad", [1, 2]), ("b", [9, 8])]:
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error" and "ValueError" in finals["bad"].error
    assert [finals["a"].output_token_ids, finals["b"].output_token_ids] == alone
    assert finals["a"].error is None and engine.num_running == 0


def _metaspace_tokenizer(path) -> Tokenizer:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *alphabet])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog ünïcödé 日本語 " * 20], trainer)
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def _old_text_and_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """Today's reference: decode everything each step, cut at the earliest stop string."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], n
    return tokenizer.decode(ids), None


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_incremental_detokenizing_matches_whole_decoding(kind, tiny_qwen3, tmp_path):
    tokenizer = Tokenizer(tiny_qwen3) if kind == "byte-level" else _metaspace_tokenizer(tmp_path)
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    texts = ["the quick brown fox 日本語 ü", "  spaces   and\nnewlines", "ünïcödé jumps over"]
    samples = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    pool = "abc xyz  \nüé日本語🙂"
    for _ in range(40):  # valid text: multi-byte characters split across tokens
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 30)))
        samples.append(tokenizer.encode(text, add_special_tokens=False))
    samples += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(40)]
    for ids in samples:
        whole = tokenizer.decode(ids)
        stops = [] if len(whole) < 4 or rng.random() < 0.3 else [whole[rng.randrange(len(whole) - 2) :][:3]]
        want_text, want_step = _old_text_and_stop(tokenizer, ids, stops)
        seq = Sequence("r", [1], SamplingParams(max_tokens=64, stop=stops))
        streamed, stopped_at = "", None
        for n, token in enumerate(ids, 1):
            seq.output_token_ids.append(token)
            if update_text(seq, tokenizer):
                stopped_at = n
                break
            streamed += take_delta(seq, finished=False)
        if stopped_at is None:
            finish_text(seq, tokenizer)
        streamed += take_delta(seq, finished=True)
        if "\ufffd" not in whole:  # invalid bytes may settle a step later; the text is the same
            assert stopped_at == want_step, (ids, stops)
        assert seq.output_text == streamed == want_text, (ids, stops)
