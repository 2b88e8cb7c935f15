"""Trace and prompt inputs of the replay client: parsing, scaling, sampling, and bad-row errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from clients.errors import ClientError
from clients.options import ReplayConfig
from clients.prompts import CharEstimate, HFTokenizer, PromptRecord, PromptSampler, load_prompts
from clients.replay import CONTEXT_MARGIN, build_requests
from clients.trace import load_azure_trace, native_rate, poisson_arrivals, scale_trace, skip, window

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_trace_offsets_and_scaling(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "t.csv",
        HEADER + "2023-11-16 18:15:46.5,10,2\n2023-11-16 18:15:47.0000000,20,4\n"
        "2023-11-16 18:15:48,30,6\n2023-11-16 18:15:50.5000000,40,8\n",
    )
    rows = load_azure_trace(p)
    assert [r.offset_s for r in rows] == pytest.approx([0.0, 0.5, 1.5, 4.0])
    assert [(r.context_tokens, r.generated_tokens) for r in rows][1] == (20, 4)
    assert native_rate(rows) == pytest.approx(3 / 4.0)
    fast = scale_trace(rows, speedup=2.0)
    assert [a.time_s for a in fast] == pytest.approx([0.0, 0.25, 0.75, 2.0])
    at_rate = scale_trace(rows, rps=1.5)  # twice the native 0.75 req/s
    assert [a.time_s for a in at_rate] == pytest.approx([0.0, 0.25, 0.75, 2.0])
    assert [a.index for a in window(at_rate, 1.0, None)] == [0, 1, 2]
    assert [a.index for a in window(at_rate, None, 2)] == [0, 1]
    assert [r.offset_s for r in skip(rows, 1.0)] == pytest.approx([0.0, 2.5])
    with pytest.raises(ClientError, match="past the trace's end"):
        skip(rows, 10.0)
    with pytest.raises(ClientError, match="not both"):
        scale_trace(rows, rps=1.0, speedup=2.0)


def test_real_azure_trace_loads(shared_data: Path) -> None:
    rows = load_azure_trace(shared_data / "arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")
    assert len(rows) == 19366
    assert 5.0 < native_rate(rows) < 6.0  # SOURCES.md: ~5.5 req/s
    arr = scale_trace(rows, rps=1.0)
    assert (len(arr) - 1) / arr[-1].time_s == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("TIME,ContextTokens,GeneratedTokens\n", 1, "expected header"),
        (HEADER + "2023-11-16 18:15:46.5,10,2\n2023-11-16 18:15:47,abc,2\n", 3, "ContextTokens 'abc'"),
        (HEADER + "2023-11-16 18:15:46.5,10,-2\n", 2, "GeneratedTokens -2 is negative"),
        (HEADER + "2023-11-16 18:15:46.5,10\n", 2, "expected 3 columns"),
        (HEADER + "16/11/2023 18:15,10,2\n", 2, "is not YYYY-MM-DD"),
        (HEADER + "2023-11-16 18:15:46.5,10,2\n2023-11-16 18:15:40,1,1\n", 3, "earlier than the row before"),
    ],
)
def test_bad_trace_rows_name_file_and_line(tmp_path: Path, text: str, line: int, what: str) -> None:
    p = write(tmp_path, "bad.csv", text)
    with pytest.raises(ClientError) as err:
        load_azure_trace(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}:{line}: ") and what in msg and "\n" not in msg


def test_empty_and_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(ClientError, match="no rows"):
        load_azure_trace(write(tmp_path, "e.csv", HEADER))
    with pytest.raises(ClientError, match="cannot open trace"):
        load_azure_trace(tmp_path / "missing.csv")


def test_poisson_arrivals_rate_and_seed() -> None:
    a = poisson_arrivals(4.0, duration_s=500.0, max_requests=None, seed=1)
    assert a[0].time_s == 0.0 and all(x.time_s < 500.0 for x in a)
    assert len(a) / 500.0 == pytest.approx(4.0, rel=0.1)
    assert [x.time_s for x in poisson_arrivals(4.0, None, 10, seed=1)] == [x.time_s for x in a[:10]]
    with pytest.raises(ClientError):
        poisson_arrivals(4.0, None, None, seed=1)


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ('{"dataset": "a", "task": "t", "prompt": ', "invalid JSON"),
        ('["a", "t", "p"]', "expected a JSON object"),
        ('{"dataset": "a", "prompt": "p"}', "field 'task'"),
        ('{"dataset": "a", "task": "t", "prompt": 3}', "field 'prompt'"),
        ('{"dataset": "a", "task": "t", "prompt": "  "}', "empty prompt"),
    ],
)
def test_bad_prompt_rows_name_file_and_line(tmp_path: Path, line: str, what: str) -> None:
    good = json.dumps({"dataset": "a", "task": "t", "prompt": "hello"})
    p = write(tmp_path, "p.jsonl", f"{good}\n\n{line}\n")
    with pytest.raises(ClientError) as err:
        load_prompts(p)
    assert str(err.value).startswith(f"{p}:3: ") and what in str(err.value)


def test_tasks_drawn_uniformly() -> None:
    # task "big" has 9 prompts, "small" 1: tasks are equally likely, not prompts
    prompts = [PromptRecord("d", "big", f"p{i}") for i in range(9)] + [PromptRecord("d", "small", "q")]
    s = PromptSampler(prompts, CharEstimate(), seed=3)
    counts = Counter(s.draw().task for _ in range(4000))
    assert counts["small"] / 4000 == pytest.approx(0.5, abs=0.04)


def test_prompts_cut_and_extended_to_length(tiny_qwen3: Path) -> None:
    prompts = [
        PromptRecord("d", f"t{i}", f"Question {i}: what is the capital of France? " * (i + 1))
        for i in range(5)
    ]
    for counter in (CharEstimate(4.0), HFTokenizer(tiny_qwen3)):
        s = PromptSampler(prompts, counter, seed=0)
        for target in (1, 7, 60, 400):
            p = s.sample(target)
            assert counter.count(p.text) <= target
            assert counter.count(p.text) >= min(target, 1) and target - counter.count(p.text) <= 2
        assert s.sample(400).pieces > 1


def test_build_requests_respects_caps_and_context(tmp_path: Path) -> None:
    trace = write(tmp_path, "t.csv", HEADER + "2023-11-16 18:15:46.5,5000,900\n2023-11-16 18:15:47,3,2\n")
    prompts = write(tmp_path, "p.jsonl", json.dumps({"dataset": "a", "task": "t", "prompt": "x" * 50}) + "\n")
    cfg = ReplayConfig(
        url="http://127.0.0.1:1", prompts=prompts, trace=trace, max_tokens_cap=64, out=tmp_path
    )
    arrivals = scale_trace(load_azure_trace(trace))
    specs = build_requests(cfg, arrivals, load_prompts(prompts), max_context=256)
    assert [s.max_tokens for s in specs] == [64, 2]
    assert specs[0].target_prompt_tokens == 256 - 64 - CONTEXT_MARGIN
    assert specs[1].target_prompt_tokens == 3 and specs[1].prompt == "x" * 12
    assert specs[0].trace_context_tokens == 5000
