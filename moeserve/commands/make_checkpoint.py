"""``moeserve make-checkpoint``: a random-weight Hugging Face checkpoint of a real MoE shape.

Example (the Mixtral-8x7B shape with 4 of its 32 layers, 11.8 GB in bf16)::

    moeserve make-checkpoint --shape mixtral-8x7b --layers 4 --out runs/ckpt/mixtral-4l

Shapes: ``mixtral-8x7b``, ``qwen3-30b-a3b``, ``qwen2-moe-a2.7b``, ``olmoe-1b-7b``,
``deepseek-v2-lite``, ``deepseek-v3``, ``glm-4.5-air``, ``gpt-oss-20b``, ``phi-3.5-moe``
(:mod:`moeserve.checkpoints.shapes`). ``--shrink N`` (hidden from ``--help``; for tests)
divides every width by N. ``--config-only`` writes the config and tokenizer but no weights, for
``--load-format dummy`` (random weights drawn in memory at load: no gigabytes written or read).
Needs ``transformers`` (the ``train`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from moeserve.checkpoints.shapes import SHAPES

    p = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint of a real MoE shape")
    p.add_argument("--shape", required=True, help=f"model shape: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, required=True, help="decoder layers to keep (1..the model's)")
    p.add_argument("--out", type=Path, required=True, help="folder to write (must be absent or empty)")
    p.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weights (default: bf16)"
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json and the tokenizer, no weights: serve or bench the folder with "
        "--load-format dummy (random weights drawn at load)",
    )
    p.add_argument("--shrink", type=int, default=1, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError
    from moeserve.checkpoints.shapes import get_shape, shrunk
    from moeserve.checkpoints.writer import DTYPES, check_out_dir, write_checkpoint, write_config_only

    shape = shrunk(get_shape(args.shape), args.shrink)
    if not 1 <= args.layers <= shape.num_layers:
        raise ConfigError(f"--layers {args.layers}: must be in 1..{shape.num_layers} for {shape.name}")
    check_out_dir(args.out)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("make-checkpoint needs transformers: pip install 'moeserve[train]'") from None
    eb = shape.expert_bytes(DTYPES[args.dtype].itemsize)
    print(
        f"{shape.name} ({shape.source}): {args.layers} of {shape.num_layers} layers, hidden {shape.hidden}, "
        f"{shape.experts} experts x {eb / 2**20:.2f} MiB, top-{shape.top_k}, vocab {shape.vocab}, "
        f"{args.dtype}",
        flush=True,
    )
    if args.config_only:
        write_config_only(shape, args.layers, args.out, args.dtype)
        print(f"wrote {args.out}: config and tokenizer, no weights (serve it with --load-format dummy)")
        return 0
    rep = write_checkpoint(
        shape, args.layers, args.out, args.dtype, args.seed, log=lambda m: print(m, flush=True)
    )
    r = rep.routing
    print(
        f"wrote {args.out}: {rep.total_bytes / 1e9:.2f} GB in {rep.shards} shards "
        f"({rep.expert_bytes / 1e9:.2f} GB experts) in {rep.seconds:.1f} s; layer-{r['layer']} routing of "
        f"{r['tokens']} random tokens: entropy {r['entropy']:.2f} of uniform, "
        f"top-1 share {r['top1_share']:.2f}, {r['distinct_topk']} distinct top-{shape.top_k} sets, "
        f"{r['experts_used']}/{shape.experts} experts used"
    )
    return 0
