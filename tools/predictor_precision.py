"""How well each predictor the ``eam`` policy blends guesses the next layer's experts, in the runtime.

Issue #15 asks for every term of the cost-aware plan to be measured per predictor. The default
``eam`` plan of the next MoE layer (distance 1, the router lookahead's depth) blends three
predictors: the router lookahead (that layer's router on the current residual stream), the batch's
own EAM so far (MoE-Infinity §3.1's skewed reuse) and the EAMC matches (§5.1). This tool runs
``moeserve bench policies``' workload (same prompts, tasks, seed, batch) through the runtime with
the ``eam`` policy at a 25% buffer and no link, its gate forced open and its trial off (so every
decode layer plans; what a predictor guesses does not depend on the buffer, the link or timing),
and at every decode MoE layer ``l < L - 1`` takes from the policy's own rows each predictor's
top ``c`` experts for layer ``l + 1`` (``c = tokens x top-k``, the plan's per-layer cap) and
checks them against the experts the batch then routes there:

* precision = guessed experts used / guessed, recall = guessed experts used / experts used;
* rows: each predictor alone, the pairs the policies use (``own + EAMC``: the row ``eam-paper``
  plans from; ``lookahead + own``: the default without the EAMC term) and the default's blend;
  ``chance``: ``c`` experts drawn at random.

Deterministic on a given machine (routing, EAMC and counts do not depend on timing). Prints a
table, ``--json`` the settings and rows; ``--doc`` writes the table into ``docs/results.md``
(block ``predictor-precision``)::

    python tools/predictor_precision.py --doc
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeserve.bench.policies import _run_batches, load_model_and_workload, register_workload_args  # noqa: E402

DOC = ROOT / "docs" / "results.md"
# row label -> description, in table order
PREDICTORS = {
    "lookahead": "router lookahead alone",
    "own": "the batch's own EAM so far alone",
    "eamc": "EAMC matches alone",
    "own+eamc": "own + EAMC (what `eam-paper` plans from)",
    "lookahead+own": "router lookahead + own (the default without the EAMC term)",
    "blend": "router lookahead + own + EAMC (the default `eam` plan)",
    "chance": "random experts, as many",
}


def _top(row: np.ndarray, c: int) -> set[int] | None:
    """The ``c`` largest positive entries of ``row`` (ties: lower expert first), or None if none."""
    row = np.asarray(row, dtype=np.float64)
    if not (row > 0).any():
        return None
    idx = np.argsort(-row, kind="stable")[:c]
    return set(idx[row[idx] > 0].tolist())


def measure(model_dir: Path, args: argparse.Namespace) -> dict:
    """Run the workload and return ``{predictor: {"precision", "recall", "guessed", "hits",
    "used"}}`` summed over the eval part's decode layers."""
    import torch

    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine

    torch.set_num_threads(1)
    base = RuntimeConfig(
        dtype="float32",
        max_batch_size=args.batch,
        cpu_threads=1,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
        buffer_fraction=0.25,
        prefetch_policy="eam",
        cache_policy="eam-reuse",
        router_lookahead=1,
    )
    loaded, warm, evals, _ = load_model_and_workload(model_dir, base, args, "predictor-precision")
    rng = np.random.default_rng(args.seed)
    tally = {name: [0, 0, 0] for name in PREDICTORS}  # hits, guessed, used
    pending: dict[int, dict[str, set[int]]] = {}
    counting = [False]
    with LLMEngine(loaded, replace(base)) as engine:
        pol = engine.prefetcher
        pol.trial = None  # every decode layer plans: the gate is forced open below
        pol.gate.force_open = True
        pol.eamc_term = None  # every plan computes the EAMC term (the runtime weighs it: term_value)
        after_routing, plan_rows = pol.after_routing, pol._plan_rows
        E, L = pol.num_experts, pol.num_layers

        def scored_after_routing(layer, request_ids, topk_ids):
            decode = topk_ids.shape[0] == len(request_ids)
            guesses = pending.pop(layer, None)
            if guesses and decode and counting[0]:
                used = set(np.unique(topk_ids).tolist())
                for name, guess in guesses.items():
                    t = tally[name]
                    t[0], t[1], t[2] = t[0] + len(used & guess), t[1] + len(guess), t[2] + len(used)
            pol._guess_cap = min(E, topk_ids.size) if decode else 0
            return after_routing(layer, request_ids, topk_ids)

        def noted_plan_rows(layer, rows, ahead):
            base, spec_rows = plan_rows(layer, rows, ahead)
            out = None if base is None else pol._blended(base, spec_rows)
            c, lo = getattr(pol, "_guess_cap", 0), layer + 1
            if not c or lo >= L:
                return base, spec_rows
            own = pol._own[lo] if pol._own is not None else None
            eamc = None
            if pol._eamc_block is not None:
                eamc = pol._eamc_block[lo - pol._window[0]]
            spec = ahead[1][:1] if ahead is not None and ahead[0] == layer else None
            guesses = {
                "lookahead": None if spec is None else _top(spec[0], c),
                "own": None if own is None else _top(own, c),
                "eamc": None if eamc is None else _top(eamc, c),
                "own+eamc": None if rows is None else _top(rows[0], c),
                "blend": None if out is None else _top(out[0], c),
                "chance": set(rng.choice(E, c, replace=False).tolist()),
            }
            if spec is not None and own is not None:  # the policy's own plan without the EAMC term
                # (as pol._note_eamc_term forms it; the unhooked _plan_rows: it calls the hook otherwise)
                alone = pol._own_rows()[0][lo : lo + len(out)]
                guesses["lookahead+own"] = _top(pol._blended(*plan_rows(layer, alone, ahead))[0], c)
            pending[lo] = {k: v for k, v in guesses.items() if v is not None}
            return base, spec_rows

        pol.after_routing, pol._plan_rows = scored_after_routing, noted_plan_rows
        _run_batches(engine, warm, args.batch, args.new_tokens)
        counting[0] = True
        _run_batches(engine, evals, args.batch, args.new_tokens)
    return {
        name: {
            "precision": h / g if g else None,
            "recall": h / u if u else None,
            "hits": h,
            "guessed": g,
            "used": u,
        }
        for name, (h, g, u) in tally.items()
    }


def render(result: dict) -> str:
    s = result["settings"]
    lines = [
        "| predictor (next MoE layer, top tokens x top-k) | precision | recall | guessed | used |",
        "|---|---|---|---|---|",
    ]
    for name, label in PREDICTORS.items():
        r = result["rows"][name]
        if r["precision"] is None:
            continue
        lines.append(f"| {label} | {r['precision']:.3f} | {r['recall']:.3f} | {r['guessed']} | {r['used']} |")
    lines.append("")
    lines.append("Settings: " + ", ".join(f"`{k}={v}`" for k, v in s.items()) + ".")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    block = f"<!-- BEGIN predictor-precision -->\n{text}\n<!-- END predictor-precision -->"
    pattern = re.compile(r"<!-- BEGIN predictor-precision -->.*?<!-- END predictor-precision -->", re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{DOC}: no predictor-precision block (BEGIN/END markers)")
    DOC.write_text(pattern.sub(lambda _: block, doc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled tiny-moe)")
    register_workload_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--doc", action="store_true", help="write the table into docs/results.md")
    args = p.parse_args(argv)
    from moeserve.commands.common import resolve_model

    model_dir = resolve_model(args)
    rows = measure(model_dir, args)
    settings = {
        "model": model_dir.name,
        "buffer": 0.25,
        "router_lookahead": 1,
        "tasks": args.tasks,
        "warm_prompts_per_task": args.warm,
        "eval_prompts_per_task": args.eval,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "seed": args.seed,
    }
    result = {"settings": settings, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
    if args.doc:
        write_doc(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
