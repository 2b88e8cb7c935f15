"""Cache hit rates replayed offline on the bundled model's own routing: LRU, ``eam-reuse`` at several
prompt weights, and Belady (the best any cache can do without prefetching).

Issue #15 asks for "a cache that knows the layers loop ... the ``eam-reuse`` idea, or better". This
tool measures how far a cache policy is from the best possible one on the workload of
``moeserve bench policies``: it decodes the eval prompts once (greedy, half the experts in the
buffer, no link) and records every MoE layer's routing (request ids, token positions,
prompt/generated flags, top-k ids), then replays the layer-by-layer expert lookups through a
buffer of ``S`` slots under

* ``lru``: evict the least recently used slot;
* ``eam-reuse w=..``: prompt tokens weighing ``w`` (``PREFILL_WEIGHT`` is the default; 1 counts
  every token alike);
* ``belady``: evict the slot whose next use is furthest in the recorded future (the runtime's
  ``oracle`` cache policy);

each the runtime's own policy class over a real :class:`tracer.recorder.RequestRecorder` fed the
same routing (:func:`replay`).

A lookup is one distinct expert a layer's tokens chose; the layer's own experts are never victims
(they are pinned while it runs, as in the runtime); a miss fills a slot at once (no link, no
timing: hit rates only, deterministic). The eval routing is recorded after the warm prompts, as in
``bench policies``; each batch's requests begin at their prefill and finish when they leave the
batch. Prints a table, or with ``--json`` the settings and rows; ``--doc`` writes the table into
``docs/results.md`` (block ``cache-headroom``)::

    python tools/cache_headroom.py --doc
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_runtime.buffer.cache_policy import make_cache_policy  # noqa: E402
from moe_runtime.buffer.policies import PREFILL_WEIGHT  # noqa: E402
from moeserve.bench.policies import _run_batches, load_model_and_workload, register_workload_args  # noqa: E402
from tracer.recorder import RequestRecorder  # noqa: E402

Routing = list[tuple[int, list[str], np.ndarray, np.ndarray, np.ndarray]]  # per routed layer


def record_routing(model_dir: Path, args: argparse.Namespace, batch: int) -> tuple[Routing, int, int, int]:
    """Decode the warm then the eval prompts at ``batch`` (greedy, no link) and return the eval
    part's routing, one ``(layer, request ids, token_seq, token_prefill, topk_ids)`` per routed
    MoE layer, with ``(L, E, k)``."""
    import torch

    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine

    torch.set_num_threads(1)
    base = RuntimeConfig(
        dtype="float32",
        max_batch_size=batch,
        cpu_threads=1,
        max_model_len=args.max_prompt_tokens + args.new_tokens + 8,
        buffer_fraction=0.5,  # offloaded (no link): the engine then keeps a recorder, whose record
        prefetch_policy="on-demand",  # we tap; outputs do not depend on the buffer
        cache_policy="eam-reuse",
    )
    loaded, warm, evals, _ = load_model_and_workload(model_dir, base, args, "cache-headroom")
    cfg = loaded.config
    out: Routing = []
    with LLMEngine(loaded, replace(base)) as engine:
        _run_batches(engine, warm, batch, args.new_tokens)
        rec = engine.recorder
        record = rec.record

        def tap(layer, ids, seq, prefill, topk, weights):
            out.append((layer, list(ids), np.array(seq), np.array(prefill), np.array(topk)))
            return record(layer, ids, seq, prefill, topk, weights)

        rec.record = tap
        _run_batches(engine, evals, batch, args.new_tokens)
    return out, cfg.num_moe_layers, cfg.num_experts, cfg.top_k


def replay(routing: Routing, L: int, E: int, k: int, slots: int, policy: str, **context) -> float:
    """Hit rate of the runtime's cache policy ``policy`` (``make_cache_policy``; ``context``: its
    extra arguments, e.g. ``prefill_weight``) over the recorded routing, with ``slots`` slots.

    The policy sees what it sees in the runtime: a :class:`tracer.recorder.RequestRecorder` fed
    the routing (requests begin at their first step and finish when they leave the batch), its
    ``after_routing`` per routed layer, then each of the layer's distinct experts looked up (a
    miss fills a free slot or the policy's victim among the slots the layer does not need); for
    ``oracle`` (Belady) an :class:`moe_runtime.prefetch.OracleSchedule` of the same lookups,
    advanced per layer as the buffer does."""
    from moe_runtime.prefetch import OracleSchedule

    log = [(layer, tuple(int(e) for e in np.unique(topk))) for layer, _, _, _, topk in routing]
    oracle = OracleSchedule(log, E) if policy == "oracle" else None
    rec = RequestRecorder(L, E, k)
    ctx = {"num_layers": L, "recorder": rec, "oracle": oracle, **context}
    pol = make_cache_policy(policy, slots, E, **ctx)
    slot_of: dict[int, int] = {}
    key_of = [-1] * slots
    live: list[str] = []
    prev_layer = L
    hits = n = 0
    for (layer, ids, seq, prefill, topk), (_, experts) in zip(routing, log):
        if layer <= prev_layer < L:
            rec.end_step()
        prev_layer = layer
        if ids != live:
            for r in live:
                if r not in ids:
                    rec.finish(r)
            for r in ids:
                if r not in live:
                    rec.begin_request(r, int(np.sum(prefill[seq == ids.index(r)])))
            live = list(ids)
        rec.record(layer, ids, seq, prefill, topk, None)
        if oracle is not None:
            oracle.advance(layer)
        pol.after_routing(layer, ids, topk)
        need = [layer * E + e for e in experts]
        for key in need:
            n += 1
            s = slot_of.get(key)
            if s is not None:
                hits += 1
                pol.on_use(s, key)
                continue
            if len(slot_of) < slots:
                s = len(slot_of)
            else:
                pinned = {slot_of[x] for x in need if x in slot_of}
                cands = np.array([i for i in range(slots) if i not in pinned], dtype=np.int64)
                if not len(cands):
                    continue  # every slot holds this layer's experts: not cached
                s = pol.victim(cands)
                del slot_of[key_of[s]]
            slot_of[key], key_of[s] = s, key
            pol.on_fill(s, key, prefetch=False)
    return hits / max(1, n)


def run(args: argparse.Namespace) -> dict:
    from moeserve.commands.common import resolve_model

    model_dir = resolve_model(args)
    rows = []
    for batch in args.batches:
        routing, L, E, k = record_routing(model_dir, args, batch)
        n = sum(len(np.unique(topk)) for *_, topk in routing)
        for frac in args.fractions:
            slots = max(1, math.ceil(frac * L * E))  # as the runtime sizes the buffer (memory_plan)
            row = {"batch": batch, "buffer_fraction": frac, "slots": slots, "lookups": n}
            row["lru"] = replay(routing, L, E, k, slots, "lru")
            for w in args.weights:
                row[f"eam-reuse w={w:g}"] = replay(routing, L, E, k, slots, "eam-reuse", prefill_weight=w)
            row["belady"] = replay(routing, L, E, k, slots, "oracle")
            rows.append(row)
    settings = {
        "model": model_dir.name,
        "tasks": args.tasks,
        "warm_prompts_per_task": args.warm,
        "eval_prompts_per_task": args.eval,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "seed": args.seed,
        "default_prefill_weight": PREFILL_WEIGHT,
    }
    return {"settings": settings, "rows": rows}


def table(result: dict) -> str:
    rows = result["rows"]
    cols = [c for c in rows[0] if c not in ("batch", "buffer_fraction", "slots", "lookups")]
    head = "| batch | buffer | slots | lookups | " + " | ".join(cols) + " |"
    sep = "|" + "---|" * (4 + len(cols))
    body = [
        f"| {r['batch']} | {r['buffer_fraction']:.0%} | {r['slots']} | {r['lookups']} | "
        + " | ".join(f"{r[c]:.3f}" for c in cols)
        + " |"
        for r in rows
    ]
    return "\n".join([head, sep, *body])


def write_doc(result: dict) -> None:
    s = result["settings"]
    w = s["default_prefill_weight"]
    block = f"""<!-- BEGIN cache-headroom -->
### Cache hit rate against Belady, replayed on the model's own routing (`tools/cache_headroom.py`)

Every cache policy replayed over the same recorded expert lookups (the eval prompts of
`bench policies`' default workload, in the settings line, decoded greedily at each batch size;
no link, no prefetching: hit rates only). `eam-reuse w=1`
counts a prompt token's choices as much as a generated token's; the default weighs them
{w:g} (`PREFILL_WEIGHT`), so the decode phase's routing, which the next decode step repeats,
dominates once a request has generated a few tokens. Belady (furthest next use evicted) is the
best any cache can do without prefetching. Command:

```bash
python tools/cache_headroom.py --doc
```

{table(result)}

Settings: {", ".join(f"`{k}={v}`" for k, v in s.items())}.
<!-- END cache-headroom -->
"""
    doc = ROOT / "docs/results.md"
    text = doc.read_text()
    if "<!-- BEGIN cache-headroom -->" in text:
        text = re.sub(
            r"<!-- BEGIN cache-headroom -->.*?<!-- END cache-headroom -->\n",
            lambda _: block,
            text,
            flags=re.S,
        )
    else:
        text = text.replace("<!-- BEGIN policy-grid -->", block + "\n<!-- BEGIN policy-grid -->")
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    register_workload_args(p)
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--batches", default="1,4,16", help="batch sizes (default: 1,4,16)")
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="buffer sizes (default: 0.1,0.25,0.5)")
    p.add_argument("--weights", default=f"1,{PREFILL_WEIGHT:g}", help="eam-reuse prompt weights")
    p.add_argument("--json", action="store_true")
    p.add_argument("--doc", action="store_true", help="write the table into docs/results.md")
    args = p.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.fractions = [float(x) for x in args.fractions.split(",")]
    args.weights = [float(x) for x in args.weights.split(",")]
    result = run(args)
    if args.doc:
        write_doc(result)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
