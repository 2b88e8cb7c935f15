"""``moeserve train-tiny``: train the bundled default MoE and/or write its model card.

Examples::

    moeserve train-tiny --out moe_runtime/assets/tiny-moe --steps 900 --seed 0 --threads 1 \\
        --card docs/model-card.md
    moeserve train-tiny --card-only --out moe_runtime/assets/tiny-moe --card docs/model-card.md

Training reads its data at train time only: ``--data-dir`` (default ``../shared/data`` next to the
repository) and this interpreter's stdlib. ``transformers`` is needed (``pip install
'moeserve[train]'``); the serving runtime never imports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tiny", help="train the bundled tiny MoE (needs the 'train' extra)")
    p.add_argument(
        "--out", type=Path, required=True, help="checkpoint folder to write (or read, --card-only)"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 900)")
    p.add_argument("--seed", type=int, default=0, help="init and batch-sampling seed (default: 0)")
    p.add_argument("--data-dir", type=Path, default=None, help="shared/data folder (default: ../shared/data)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per step, a multiple of 4 (default: 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: 256)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument(
        "--card", type=Path, default=None, help="write the model card here (figures go to <card dir>/img/)"
    )
    p.add_argument("--card-only", action="store_true", help="skip training; analyse --out and write --card")
    p.set_defaults(func=run)


def _require_transformers() -> None:
    from moe_runtime.errors import ConfigError

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("train-tiny needs transformers: pip install 'moeserve[train]'") from None


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError

    _require_transformers()
    from moeserve.train.corpus import build_corpus
    from moeserve.train.shape import TrainSettings, format_split
    from moeserve.train.trainer import train

    if args.card_only and args.card is None:
        raise ConfigError("--card-only needs --card PATH")
    split = build_corpus(args.data_dir)
    if not args.card_only:
        overrides = {
            k: v
            for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("seq_len", args.seq_len))
            if v is not None
        }
        settings = TrainSettings(seed=args.seed, threads=args.threads, **overrides)
        if settings.batch_size % 4:
            raise ConfigError(
                f"--batch-size {settings.batch_size}: must be a multiple of 4 (one row per domain)"
            )
        result = train(split, args.out, settings=settings, log=lambda m: print(m, flush=True))
        print(format_split(result["params"]))
        print(f"checkpoint written to {args.out} in {result['time_s']['total']:.0f} s")
    if args.card is not None:
        from moeserve.train.model_card import write_card

        write_card(args.out, split, args.card, log=lambda m: print(m, flush=True))
        print(f"model card written to {args.card}")
    return 0
