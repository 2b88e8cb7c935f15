"""Record expert traces of task-labelled prompts with the runtime (``moeserve trace record``).

Draws prompts from a JSONL of ``{dataset, task, prompt}`` (the same selection as
``bench policies``), decodes ``--max-tokens`` greedy tokens for each in batches, and writes one
trace line per request (``docs/trace-format.md``) with its task label. ``--skip`` prompts per task
are passed over first, so two calls with different ``--skip`` give disjoint warm/eval sets.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from moeserve.bench.prompts import prompts_by_task


def add_record_parser(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser("record", help="record expert traces of task-labelled prompts with the runtime")
    add_model_arg(p)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {dataset, task, prompt}")
    p.add_argument("--out", type=Path, required=True, help="trace file to write (appends)")
    p.add_argument("--tasks", type=int, default=12, help="tasks drawn (seeded)")
    p.add_argument("--per-task", type=int, default=8, help="prompts per task")
    p.add_argument("--skip", type=int, default=0, help="prompts per task passed over first")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def select_prompts(path: Path, tasks: int, per_task: int, skip: int, seed: int) -> list[tuple[str, str]]:
    """``[(task, prompt)]``: ``tasks`` seeded tasks with enough prompts, ``per_task`` each after ``skip``."""
    by_task = prompts_by_task(path)
    rng = random.Random(seed)
    eligible = sorted(t for t, ps in by_task.items() if len(ps) >= skip + per_task)
    out = []
    for task in rng.sample(eligible, min(tasks, len(eligible))):
        prompts = by_task[task][:]
        random.Random(f"{seed}/{task}").shuffle(prompts)
        out += [(task, p) for p in prompts[skip : skip + per_task]]
    return out


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams
    from moe_runtime.loader import load_checkpoint
    from moeserve.commands.common import resolve_model
    from tracer.recorder import RequestRecorder
    from tracer.trace_file import TraceWriter

    rt = RuntimeConfig(
        max_batch_size=args.batch, cpu_threads=1, max_model_len=args.max_prompt_tokens + args.max_tokens + 8
    )
    loaded = load_checkpoint(resolve_model(args), rt)
    cfg = loaded.config
    chosen = select_prompts(args.prompts, args.tasks, args.per_task, args.skip, args.seed)
    writer = TraceWriter(args.out)
    recorder = RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, trace_writer=writer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with LLMEngine(loaded, rt, recorder=recorder) as engine:
        for i in range(0, len(chosen), args.batch):
            for j, (task, prompt) in enumerate(chosen[i : i + args.batch]):
                ids = loaded.tokenizer.encode(prompt)[: args.max_prompt_tokens] or [0]
                engine.add_request(f"{task}#{args.skip + i + j}", ids, params, task=task)
            while engine.has_unfinished():
                engine.step()
    writer.close()
    print(
        f"wrote {len(chosen)} request traces ({len({t for t, _ in chosen})} tasks) to {args.out}",
        file=sys.stderr,
    )
    return 0
