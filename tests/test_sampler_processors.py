"""Logits processors in the sampler agree with transformers' own processors on the same logits,
are vectorised over mixed batches without touching rows that do not use them, and keep greedy
rows bit-identical."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from moe_runtime.engine.request import SamplingParams
from moe_runtime.engine.sampler import min_p_filter, process_logits, sample

V = 50


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


def _history(seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (7,), generator=g).tolist(), torch.randint(0, V, (9,), generator=g).tolist()


def test_repetition_penalty_equals_transformers():
    logits = _logits(3)
    history = [_history(i) for i in range(3)]
    for penalty in (0.5, 1.3, 2.0):
        params = [SamplingParams(repetition_penalty=penalty) for _ in range(3)]
        ours = process_logits(logits, params, history)
        for i, (prompt, output) in enumerate(history):
            ids = torch.tensor([prompt + output])
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())
            torch.testing.assert_close(ours[i : i + 1], theirs, rtol=0, atol=0)


def test_presence_and_frequency_follow_openai_definition():
    logits = _logits(2, seed=1)
    history = [_history(5), _history(6)]
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3),
        SamplingParams(frequency_penalty=1.5),
    ]
    ours = process_logits(logits, params, history)
    for i, (_, output) in enumerate(history):
        want = logits[i].clone()
        for t in set(output):  # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
            want[t] -= output.count(t) * params[i].frequency_penalty + params[i].presence_penalty
        torch.testing.assert_close(ours[i], want, rtol=0, atol=1e-6)


def test_logit_bias_equals_transformers_sequence_bias():
    logits = _logits(1, seed=2)
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    ours = process_logits(logits, [SamplingParams(logit_bias=bias)])
    theirs = SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()})(
        torch.tensor([[1]]), logits.clone()
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_min_p_equals_transformers():
    logits = _logits(4, seed=3)
    for min_p in (0.05, 0.3, 0.9):
        ours = min_p_filter(logits, torch.full((4, 1), min_p))
        theirs = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)], rtol=0, atol=0)


def test_untouched_rows_stay_bit_identical_and_greedy_follows_the_processed_logits():
    logits = _logits(4, seed=4)
    history = [_history(i) for i in range(4)]
    plain = SamplingParams(temperature=0)
    top = int(logits[1].argmax())
    params = [
        plain,
        SamplingParams(temperature=0, logit_bias={top: -100.0}),
        plain,
        SamplingParams(temperature=0),
    ]
    params[3].repetition_penalty = 1.5
    out = process_logits(logits, params, history)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert process_logits(logits, [plain] * 4, history) is logits  # nothing to do: no copy at all
    picks = sample(logits, params, [None] * 4, history)
    assert picks[0].token == int(logits[0].argmax()) and picks[2].token == int(logits[2].argmax())
    assert picks[1].token != top and picks[1].token == int(out[1].argmax())


def test_min_p_one_keeps_only_the_top_token_when_sampling():
    logits = _logits(2, seed=5)
    params = [SamplingParams(temperature=1.0, min_p=1.0) for _ in range(2)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    for _ in range(5):
        picks = sample(logits, params, gens)
        assert [p.token for p in picks] == logits.argmax(-1).tolist()


def test_a_mask_that_allows_nothing_fails_only_its_row():
    logits = _logits(2, seed=6)
    none_allowed = torch.zeros(V, dtype=torch.bool)
    picks = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None], allowed={0: none_allowed})
    assert isinstance(picks[0], Exception) and picks[1].token == int(logits[1].argmax())


def test_drawn_rows_take_torch_multinomials_ids_without_a_host_sync_each():
    """A seeded row draws the id ``torch.multinomial`` draws from the same generator (its own
    one-sample algorithm), and the rows' ids reach the host together: the host syncs per step do
    not grow with the drawn rows (a GPU pays each one), none of them a scalar read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        scalars = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.scalars += str(func) == "aten._local_scalar_dense.default"
            return func(*args, **(kwargs or {}))

    class Copies(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Copies.calls += getattr(func, "__name__", "") in {"tolist", "item", "cpu"}
            return func(*args, **(kwargs or {}))

    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(8)]
    want = [
        int(torch.multinomial((logits[i] / 0.7).softmax(-1), 1, generator=torch.Generator().manual_seed(i)))
        for i in range(8)
    ]
    copies = []
    for n in (1, 8):
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        Reads.scalars = Copies.calls = 0
        with Reads(), Copies():
            got = sample(logits[:n], params[:n], gens)
        assert [g.token for g in got] == want[:n]
        assert Reads.scalars == 0
        copies.append(Copies.calls)
    assert copies[0] == copies[1] == 2, copies  # the greedy rows' copy and the drawn rows' copy


def test_prompt_logprobs_equal_teacher_forced_logits_with_chunked_prefill(tiny_qwen3):
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine

    prompt = list(range(5, 40))
    with LLMEngine.from_pretrained(
        tiny_qwen3, RuntimeConfig(max_batch_size=2, max_num_batched_tokens=16, max_model_len=64)
    ) as engine:
        want = engine.prefill_logits(prompt).log_softmax(-1)
        plain, scored = engine.generate(
            [prompt[:9], prompt],
            [
                SamplingParams(max_tokens=3, temperature=0),
                SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
            ],
        )
        alone = engine.generate([prompt[:9]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.output_token_ids == alone.output_token_ids
    lps = scored.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None  # 35 tokens over 16-token chunks: 3 steps
    for j, lp in enumerate(lps[1:]):
        assert lp.token_id == prompt[j + 1]
        assert abs(lp.logprob - float(want[j, prompt[j + 1]])) < 1e-4
        assert list(lp.top) == want[j].topk(2).indices.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_processors_on_cuda_logits_equal_cpu():
    logits = _logits(3, seed=7)
    history = [_history(i) for i in range(3)]
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={4: 3.0}),
        SamplingParams(temperature=0.8, min_p=0.2, frequency_penalty=0.4),
        SamplingParams(temperature=0),
    ]
    allowed = {1: torch.arange(V) % 2 == 0}
    cpu = process_logits(logits, params, history, allowed)
    gpu = process_logits(logits.cuda(), params, history, {1: allowed[1].cuda()})
    torch.testing.assert_close(gpu.cpu(), cpu)
    picks = sample(
        logits.cuda(), params, [None, torch.Generator(device="cuda").manual_seed(0), None], history
    )
    assert all(not isinstance(p, Exception) for p in picks)
