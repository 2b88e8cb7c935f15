"""``moeserve trace {stats,import,predict-eval}``: look at expert-activation traces.

* ``stats FILE`` -- activation ratio, within-request skew and cross-layer correlation
  (MoE-Infinity §3.1) of a trace file.
* ``import SRC... --out DST`` -- convert per-token routing logs (``*_routing.jsonl``) into our
  trace format (``docs/trace-format.md``).
* ``record --prompts JSONL --out FILE`` -- run task-labelled prompts through the runtime and
  record their traces (``moeserve/bench/record_traces.py``).
* ``predict-eval --warm FILE --eval FILE`` -- precision/recall of predicting the experts of layer
  ``l + d`` by EAMC matching, lifetime counts and the previous token (MoE-Infinity §5.1, §7.2).

Bad input files raise :class:`tracer.errors.TracerError`, which ``moeserve`` prints as one line
with exit status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_runtime.paths import shown_path as _shown


def _stats(args: argparse.Namespace) -> int:
    from tracer.analysis import print_stats, trace_stats
    from tracer.trace_file import load_traces

    stats = trace_stats(load_traces(args.file))
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print_stats(stats, title=_shown(args.file))
    return 0


def _import(args: argparse.Namespace) -> int:
    from tracer.import_routing import import_routing
    from tracer.trace_file import write_traces

    records = import_routing(args.src, num_experts=args.num_experts)
    write_traces(args.out, records)
    r0 = records[0]
    tokens = sum(r.num_tokens for r in records)
    missing = sum(int(r.meta.get("missing_cells", 0)) for r in records)
    print(
        f"wrote {len(records)} requests ({tokens} tokens, L={r0.num_layers} E={r0.num_experts} "
        f"top_k={r0.top_k}, {missing} (token, layer) cells missing) to {args.out}"
    )
    return 0


def _predict_eval(args: argparse.Namespace) -> int:
    from tracer.predict_eval import evaluate, print_eval
    from tracer.trace_file import load_traces

    result = evaluate(
        load_traces(args.warm),
        load_traces(args.eval),
        distances=tuple(args.distances),
        matches=args.matches,
        predict_k=args.predict_k,
        capacity=args.capacity,
        online=args.online,
    )
    result["settings"].update(warm=_shown(args.warm), eval=_shown(args.eval))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_eval(result)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``trace`` and its sub-subcommands to the ``moeserve`` parser."""
    parser = sub.add_parser("trace", help="expert-activation traces: stats, import, record, predict-eval")
    cmds = parser.add_subparsers(dest="trace_command", metavar="TRACE_COMMAND")
    cmds.required = True

    p = cmds.add_parser("stats", help="activation ratio, skew and cross-layer correlation of a trace file")
    p.add_argument("file", type=Path, help="trace file (moeserve-trace/1 JSON lines)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_stats)

    p = cmds.add_parser("import", help="convert per-token routing logs (*_routing.jsonl) to a trace file")
    p.add_argument("src", type=Path, nargs="+", help="routing log(s)")
    p.add_argument("--out", type=Path, required=True, help="trace file to write (replaced atomically)")
    p.add_argument("--num-experts", type=int, default=None, help="E (default: largest id seen + 1)")
    p.set_defaults(func=_import)

    p = cmds.add_parser("predict-eval", help="precision/recall of next-layer expert prediction")
    p.add_argument("--warm", type=Path, required=True, help="trace file whose requests fill the EAMC")
    p.add_argument("--eval", type=Path, required=True, help="trace file of the requests to predict")
    p.add_argument("--distances", type=int, nargs="+", default=[1, 2, 3], help="layers ahead (default 1 2 3)")
    p.add_argument("--matches", type=int, default=4, help="EAMC matches aggregated per query")
    p.add_argument("--predict-k", type=int, default=None, help="experts predicted per layer (default top_k)")
    p.add_argument("--capacity", type=int, default=1000, help="EAMC capacity")
    p.add_argument("--online", action="store_true", help="add each eval request to the EAMC after it")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_predict_eval)

    from moeserve.bench.record_traces import add_record_parser

    add_record_parser(cmds)
