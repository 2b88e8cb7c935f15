"""``moeserve bench quant-loss``: held-out loss of a checkpoint with its experts in each ``--expert-dtype``.

Transformers' forward pass in fp32 with every routed expert replaced by the runtime's stored
expert, dequantized (:mod:`moeserve.train.quant_loss`), on the training recipe's held-out windows
rebuilt from the corpus (``--data-dir``, default ``../shared/data``). Per format: the loss per
domain, their mean and its rise over the first format (``auto``: the checkpoint's experts as
stored), bytes per expert. The figures are deterministic (fp32 on fixed windows, one CPU thread):
a repeat gives the same numbers, so the command computes each once and says so in its settings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.commands.common import add_model_arg
    from moeserve.train.quant_loss import FORMATS

    p = sub.add_parser("quant-loss", help="held-out loss per expert format (--expert-dtype)")
    add_model_arg(p)
    p.add_argument("--data-dir", type=Path, default=None, help="corpus data (default: ../shared/data)")
    p.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help=f"--expert-dtype values; the first is the base (default: {','.join(FORMATS)})",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from moeserve.commands.common import resolve_model
    from moeserve.train.quant_loss import heldout_windows, measure, render

    torch.set_num_threads(1)
    model_dir = resolve_model(args)
    t0 = time.monotonic()
    result = measure(model_dir, heldout_windows(model_dir, args.data_dir), tuple(args.formats.split(",")))
    result["settings"] = {
        "model": model_dir.name,
        "formats": args.formats.split(","),
        "compute": "transformers forward, fp32, 1 CPU thread",
        "repeats": "1: deterministic (fp32 on fixed windows; a repeat gives the same figures)",
        "torch": torch.__version__,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
        print("settings: " + ", ".join(f"{k}={v}" for k, v in result["settings"].items()))
    return 0
