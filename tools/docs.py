"""Regenerate every generated block of the docs from its committed results; re-measure on request.

A generated block sits between ``<!-- BEGIN generated:NAME -->`` and ``<!-- END generated:NAME -->``
in one of the docs. It shows the command that measures it, a line naming the commit, host and date
of the figures, and the figures. Its data is ``docs/data/NAME.json``: the JSON the command printed,
kept with that command, the commit it ran at, the host and the date.

    python tools/docs.py                       # re-render every block from docs/data (no measuring)
    python tools/docs.py --run NAME ...        # run NAME's command, keep its JSON, re-render its block
    python tools/docs.py --import NAME FILE --host "..."   # wrap a JSON measured elsewhere (a GPU)
    python tools/docs.py --check               # exit 1 if a block differs from its rendering
    python tools/docs.py --list                # the blocks, their docs, minutes and commands

Rendering never deletes results: a block whose data file is missing is left as it is (its figures
were written before this tool, stamped with their commit), and the tool says so. The registry is
:data:`BLOCKS`; a block's renderer takes the command's JSON and returns Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"<!-- BEGIN generated:([\w.-]+) -->")

SHARED_TRACE = "../shared/data/arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
SHARED_PROMPTS = "../shared/data/prompts/prompts_combined.jsonl"
# the GPU rows, as tools/gpu_check.sh runs them (its JSON goes in with --import)
CUDA_DECODE = (
    "--device cuda --dtype bf16 --link-gbps 0 --prefill-len 2048 --fractions 1.0,0.25 --repeats 3 --json"
)
MIXTRAL_LOGS = "../shared/data/routing_traces/mixtral_8x7b_instruct_fp8"
# the client side of the two serving blocks: the Azure conversation trace, the task-labelled prompts
CLIENT = (
    f"--trace {SHARED_TRACE} --prompts {SHARED_PROMPTS} --trace-offset 60 --duration 120 "
    "--max-tokens-cap 128 --tokenizer moe_runtime/assets/tiny-moe --slo-tpot-ms 200 --seed 0"
)


@dataclass(frozen=True)
class Block:
    """One generated block.

    Attributes:
        doc: the doc holding it, relative to the repository root.
        command: the shell command (one or more lines) that measures it, run by ``bash`` from the
            repository root; the JSON it prints on standard output is the block's data (several JSON
            documents: a list of them, in order). Shown in the block as it is run.
        render: ``"module:function"``, a function of the command's JSON returning Markdown.
        minutes: about how long ``--run`` takes on a 2-core host, for ``--list``.
        needs: what the command needs beyond a checkout (``../shared``, a CUDA device), for ``--list``.
    """

    doc: str
    command: str
    render: str
    minutes: float
    needs: str = ""


BLOCKS: dict[str, Block] = {
    "decode-cpu": Block(
        "docs/benchmarks.md",
        "moeserve bench decode --json",
        "moeserve.bench.render:render_decode",
        6,
        "../shared (prompts)",
    ),
    "decode-cpu-compiled": Block(
        "docs/benchmarks.md",
        "moeserve bench decode --compile-decode --fractions 1.0 --link-gbps 0 --prefill-len 0 --json",
        "moeserve.bench.render:render_decode",
        4,
    ),
    "decode-cuda": Block(
        "docs/benchmarks.md",
        f"moeserve bench decode {CUDA_DECODE}",
        "moeserve.bench.render:render_decode",
        2,
        "a CUDA device",
    ),
    "decode-cuda-qwen3": Block(
        "docs/benchmarks.md",
        "moeserve make-checkpoint --shape qwen3-30b-a3b --layers 8 --out runs/ckpt/qwen3-8l\n"
        f"moeserve bench decode --model runs/ckpt/qwen3-8l {CUDA_DECODE}",
        "moeserve.bench.render:render_decode",
        6,
        "a CUDA device, 12 GB of disk",
    ),
    "launches-cuda": Block(
        "docs/benchmarks.md",
        "moeserve bench launches --device cuda --json",
        "moeserve.bench.launches:render",
        1,
        "a CUDA device",
    ),
    "launches-cpu-compiled": Block(
        "docs/benchmarks.md",
        "moeserve bench launches --device cpu --compile-decode --json",
        "moeserve.bench.launches:render",
        2,
    ),
    "regression-cpu": Block(
        "docs/benchmarks.md",
        "python tools/bench_regression.py --base 303d5a9 --json",
        "tools.bench_regression:render",
        25,
    ),
    "regression-cpu-eager": Block(
        "docs/benchmarks.md",
        "python tools/bench_regression.py --base 303d5a9 --eager --json",
        "tools.bench_regression:render",
        20,
    ),
    "experts-cpu": Block(
        "docs/benchmarks.md",
        "moeserve bench experts --device cpu --dtype fp32 --shapes bundled,qwen3-30b-a3b "
        "--tokens 1,2,3,4,8,64 --repeats 3 --calls 5 --json",
        "moeserve.bench.experts:render",
        2,
    ),
    "quant-decode": Block(
        "docs/quantization.md",
        "moeserve bench decode --fractions 0.25 --batches 1 --prefill-len 0 --link-gbps 0.5 "
        "--no-transformers --expert-dtypes bf16,fp8,int8,mxfp4 --json",
        "moeserve.bench.render:render_quant_decode",
        4,
        "../shared (prompts)",
    ),
    "quant-loss": Block(
        "docs/quantization.md",
        "moeserve bench quant-loss --json",
        "moeserve.train.quant_loss:render",
        1,
        "../shared (the training corpus)",
    ),
    "policies": Block(
        "docs/results.md",
        "moeserve bench policies --json",
        "moeserve.bench.render:render_policies",
        25,
        "../shared (prompts)",
    ),
    "policy-grid": Block(
        "docs/results.md",
        "moeserve bench policies --policies on-demand+lru,eam --link-gbps 0.5,4,32,0 --batch 1,4,16 "
        "--tasks 8 --warm 2 --eval 2 --new-tokens 16 --min-batches 4 --json",
        "moeserve.bench.policy_grid:render_grid",
        17,
        "../shared (prompts)",
    ),
    "replay": Block(
        "docs/results.md",
        "moeserve serve --port 18080 --buffer-fraction 0.25 --link-gbps 0.5 &\n"
        "SERVER=$!\n"
        f"moeserve replay --url http://127.0.0.1:18080 --rps 0.5 {CLIENT} --out runs/replay-conv "
        "&& cat runs/replay-conv/summary.json\n"
        "kill $SERVER",
        "moeserve.bench.render:render_replay",
        3,
        "../shared (trace, prompts)",
    ),
    "sweep": Block(
        "docs/results.md",
        "moeserve serve --port 18081 --buffer-fraction 0.25 --link-gbps 0.5 &\n"
        "SERVER=$!\n"
        f"moeserve bench sweep --url http://127.0.0.1:18081 --rates 0.25,0.5,1,1.5 {CLIENT} "
        "--out runs/sweep-conv --json\n"
        "kill $SERVER",
        "moeserve.bench.render:render_sweep",
        10,
        "../shared (trace, prompts)",
    ),
    "sim-mixtral": Block(
        "docs/simulator.md",
        "moeserve trace import --num-experts 8 --out runs/traces/mixtral_8x7b.jsonl "
        f"{MIXTRAL_LOGS}/gsm8k_2_routing.jsonl {MIXTRAL_LOGS}/humaneval_2_routing.jsonl\n"
        "for hw in a5000 h100; do\n"
        "  moeserve simulate --trace runs/traces/mixtral_8x7b.jsonl --model-profile mixtral-8x7b "
        "--hardware $hw --all-policies --warm 1 --json\n"
        "done",
        "moeserve.sim.report:render_simulate",
        1,
        "../shared (routing logs)",
    ),
    "sim-hybrid": Block(
        "docs/simulator.md",
        "moeserve trace import --num-experts 8 --out runs/traces/mixtral_8x7b.jsonl "
        f"{MIXTRAL_LOGS}/gsm8k_2_routing.jsonl {MIXTRAL_LOGS}/humaneval_2_routing.jsonl\n"
        "for b in 1 16; do\n"
        + "".join(
            "  moeserve simulate --trace runs/traces/mixtral_8x7b.jsonl --model-profile mixtral-8x7b "
            f"--hardware {hw} --batch $b --split-eval $b --policy eam,oracle --expert-compute device,cpu,auto "
            "--prefill-tokens 512 --warm 1 --json\n"
            for hw in ("a5000 --buffer-slots 57", "h100 --buffer-slots 100")
        )
        + "done",
        "moeserve.sim.report:render_simulate_hybrid",
        1,
        "../shared (routing logs)",
    ),
    "cpu-experts": Block(
        "docs/hybrid.md",
        "moeserve bench cpu-experts --shapes qwen3-30b-a3b,mixtral-8x7b --tokens 1 "
        "--formats fp32,bf16,int8,fp8,mxfp4 --json",
        "moeserve.bench.cpu_experts:markdown",
        5,
    ),
    "hybrid-bundled": Block(
        "docs/hybrid.md",
        "moeserve bench hybrid --modes device,cpu,auto --repeats 5 --prefill-len 256 --json",
        "moeserve.bench.hybrid:markdown",
        2,
    ),
    "hybrid-olmoe": Block(
        "docs/hybrid.md",
        "[ -d runs/ckpt/olmoe-4l ] || moeserve make-checkpoint --shape olmoe-1b-7b --layers 4 "
        "--out runs/ckpt/olmoe-4l > /dev/null\n"
        "moeserve bench hybrid --model runs/ckpt/olmoe-4l --modes device,cpu,auto --repeats 3 "
        "--prefill-len 256 --json",
        "moeserve.bench.hybrid:markdown",
        10,
        "7 GB of disk",
    ),
    "kv": Block(
        "docs/kv-cache.md",
        "moeserve bench kv --rate 20 --json\nmoeserve bench kv --rate 4 --json\nmoeserve bench kv --prefix-chat --json",
        "moeserve.bench.kv:markdown",
        3,
        "../shared (trace)",
    ),
    "memory-split": Block(
        "docs/operations.md",
        "moeserve bench memory-split --json",
        "moeserve.bench.memory_split:markdown",
        6,
        "../shared (prompts)",
    ),
    "overhead": Block(
        "docs/simulator.md",
        "moeserve bench overhead --sections --repeats 5 --json",
        "moeserve.bench.render:render_overhead",
        15,
    ),
    "eamc-search": Block(
        "docs/tracer.md",
        "for capacity in 1000 10000; do\n"
        "  moeserve bench eamc --capacity $capacity --layers 32 --experts 8 --iters 100 --warmup 10 --json\n"
        "  moeserve bench eamc --capacity $capacity --layers 35 --experts 128 --iters 100 --warmup 10 --json\n"
        "done",
        "moeserve.bench.render:render_eamc",
        3,
    ),
    "eamc-capacity": Block(
        "docs/tracer.md",
        "rm -rf runs/eamc\n"
        f"P={SHARED_PROMPTS}\n"
        "moeserve trace record --prompts $P --tasks 120 --per-task 12 --max-tokens 24 --batch 16 --seed 0 "
        "--out runs/eamc/a-warm.jsonl\n"
        "moeserve trace record --prompts $P --tasks 120 --per-task 2 --skip 12 --max-tokens 24 --batch 16 "
        "--seed 0 --out runs/eamc/a-eval.jsonl\n"
        "moeserve trace record --prompts $P --tasks 400 --per-task 3 --max-tokens 24 --batch 16 --seed 1 "
        "--out runs/eamc/b-warm.jsonl\n"
        "moeserve trace record --prompts $P --tasks 400 --per-task 1 --skip 3 --max-tokens 24 --batch 16 "
        "--seed 1 --out runs/eamc/b-eval.jsonl\n"
        "moeserve bench eamc --capacities 32,64,128,256,512,1000 --layers 48 --experts 128 --batch 16 --k 16 "
        "--repeats 5 --traces runs/eamc/a-warm.jsonl runs/eamc/a-eval.jsonl "
        "--traces runs/eamc/b-warm.jsonl runs/eamc/b-eval.jsonl --json",
        "moeserve.bench.eamc_capacity:render_capacities",
        15,
        "../shared (prompts)",
    ),
}


def _begin(name: str) -> str:
    return f"<!-- BEGIN generated:{name} -->"


def _end(name: str) -> str:
    return f"<!-- END generated:{name} -->"


def _renderer(block: Block) -> Callable[[Any], str]:
    module, func = block.render.split(":")
    return getattr(importlib.import_module(module), func)


def data_path(name: str) -> Path:
    return DATA / f"{name}.json"


def render_block(name: str, data: dict) -> str:
    """The block's body: the command that produced the data, a line naming commit, host and date,
    then the rendered result."""
    block = BLOCKS[name]
    stamp = (
        f"_Measured at commit `{data['commit']}` on {data['host']}, {data['date']}; "
        f"`python tools/docs.py --run {name}` measures it again._"
    )
    body = _renderer(block)(data["result"]).strip()
    return f"```bash\n{data['command']}\n```\n\n{stamp}\n\n{body}\n"


def block_text(text: str, name: str) -> str | None:
    """The body of block ``name`` in ``text`` (between its markers), or None when it is not there."""
    m = re.search(re.escape(_begin(name)) + r"\n(.*?)" + re.escape(_end(name)), text, re.DOTALL)
    return m.group(1) if m else None


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name``'s body replaced.

    Raises:
        KeyError: the doc holds no such block (or its END marker is missing).
    """
    pattern = re.compile(re.escape(_begin(name)) + r"\n.*?" + re.escape(_end(name)), re.DOTALL)
    if not pattern.search(text):
        raise KeyError(f"no block {_begin(name)} ... {_end(name)}")
    return pattern.sub(lambda _: f"{_begin(name)}\n{body}{_end(name)}", text, count=1)


def host() -> str:
    """The host as the figures depend on it: CPU model and cores, and the GPU when one is present."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{model}, {cores} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return text


def commit() -> str:
    """The short commit of the working tree, ``+dirty`` when tracked files outside ``docs/`` differ
    from it (the docs, which ``--run`` rewrites as it goes, do not change what is measured)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":!docs"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def json_documents(text: str) -> list[Any]:
    """The JSON documents in a command's output, in order: each starts with ``{`` or ``[`` at the
    start of a line (other lines, such as a tool's progress, are skipped)."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        if text[pos] in "{[":
            try:
                doc, end = decoder.raw_decode(text, pos)
            except ValueError:
                pass
            else:
                docs.append(doc)
                pos = end
                continue
        nl = text.find("\n", pos)
        if nl < 0:
            break
        pos = nl + 1
    return docs


def record(name: str, result: Any, commit_: str, host_: str, date: str) -> dict:
    """The data record of block ``name``: its command's JSON and where and when it was measured."""
    return {
        "block": name,
        "command": BLOCKS[name].command,
        "commit": commit_,
        "host": host_,
        "date": date,
        "result": result,
    }


def write_record(name: str, data: dict) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    data_path(name).write_text(json.dumps(data, indent=1) + "\n")


def run(name: str) -> dict:
    """Run block ``name``'s command with bash from the repository root; keep and return its record."""
    block = BLOCKS[name]
    print(f"{name}: running (about {block.minutes:g} min) ...\n{block.command}", file=sys.stderr)
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # this moeserve
    out = subprocess.run(["bash", "-c", block.command], cwd=ROOT, env=env, capture_output=True, text=True)
    docs = json_documents(out.stdout)
    if out.returncode or not docs:
        why = f"exited with {out.returncode}" if out.returncode else "printed no JSON"
        sys.exit(f"{name}: the command {why}:\n{out.stderr[-2000:]}")
    data = record(
        name, docs[0] if len(docs) == 1 else docs, commit(), host(), datetime.date.today().isoformat()
    )
    write_record(name, data)
    return data


def import_file(name: str, path: Path, commit_: str | None, host_: str | None, date: str | None) -> dict:
    """Wrap a JSON measured elsewhere (a GPU machine) as block ``name``'s record. A file that is
    already a record keeps its commit, host and date unless they are given."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and {"result", "commit", "host"} <= set(data):
        data = record(
            name, data["result"], commit_ or data["commit"], host_ or data["host"], date or data["date"]
        )
    else:
        if not host_:
            sys.exit(f"--import {name}: {path} is the command's bare JSON; say where it ran with --host")
        modified = datetime.datetime.fromtimestamp(path.stat().st_mtime).date().isoformat()
        data = record(name, data, commit_ or commit(), host_, date or modified)
    write_record(name, data)
    return data


def doc_markers() -> dict[str, list[str]]:
    """Every ``BEGIN generated`` marker of README.md and docs/*.md: block name -> docs holding it."""
    found: dict[str, list[str]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in MARKER.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def regenerate(names: list[str], write: bool, missing: list[str] | None = None) -> list[str]:
    """Re-render blocks ``names``; returns the docs whose text differs from the rendering (and,
    with ``write``, rewrites them). A block without data is left alone with a note; a block whose
    doc lacks its markers is named (and added to ``missing``)."""
    changed: dict[str, str] = {}
    for name in names:
        block = BLOCKS[name]
        path = data_path(name)
        if not path.exists():
            print(f"{name}: left as it is, no {path.relative_to(ROOT)}", file=sys.stderr)
            continue
        doc = ROOT / block.doc
        text = changed.get(block.doc, doc.read_text(encoding="utf-8"))
        try:
            changed[block.doc] = replace_block(text, name, render_block(name, json.loads(path.read_text())))
        except KeyError:
            print(f"{name}: {block.doc} has no {_begin(name)} ... {_end(name)}", file=sys.stderr)
            if missing is not None:
                missing.append(name)
    stale = [d for d, text in changed.items() if (ROOT / d).read_text(encoding="utf-8") != text]
    if write:
        for d in stale:
            (ROOT / d).write_text(changed[d], encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs="+", metavar="NAME", help="measure these blocks again, then render")
    p.add_argument(
        "--import", dest="import_", nargs=2, metavar=("NAME", "FILE"), help="wrap FILE as NAME's data"
    )
    p.add_argument("--commit", help="with --import: the commit FILE was measured at (default: this tree's)")
    p.add_argument("--host", help="with --import: the host FILE was measured on")
    p.add_argument("--date", help="with --import: the date (default: FILE's modification date)")
    p.add_argument("--check", action="store_true", help="exit 1 if a doc differs from its rendering")
    p.add_argument("--list", action="store_true", help="list the blocks")
    args = p.parse_args(argv)
    if args.list:
        for name, b in BLOCKS.items():
            has = "data" if data_path(name).exists() else "no data"
            needs = f"  needs {b.needs}" if b.needs else ""
            print(f"{name:20} {b.doc:22} ~{b.minutes:g} min  {has}{needs}")
            print("    " + b.command.replace("\n", "\n    "))
        return 0
    unknown = [n for n in (args.run or []) + ([args.import_[0]] if args.import_ else []) if n not in BLOCKS]
    if unknown:
        sys.exit(f"unknown block {unknown[0]!r}; --list shows them")
    if args.import_:
        import_file(args.import_[0], Path(args.import_[1]), args.commit, args.host, args.date)
    for name in args.run or []:
        run(name)
    unregistered = sorted(set(doc_markers()) - set(BLOCKS))
    if unregistered:
        print(
            f"blocks in the docs but not in BLOCKS (left as they are): {', '.join(unregistered)}",
            file=sys.stderr,
        )
    missing: list[str] = []
    stale = regenerate(list(BLOCKS), write=not args.check, missing=missing)
    if args.check and stale:
        print("out of date (run python tools/docs.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    for d in [] if args.check else stale:
        print(f"wrote {d}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
