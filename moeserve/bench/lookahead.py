"""``moeserve bench lookahead``: how well the router lookahead predicts later layers' experts.

Runs the workload of ``moeserve bench policies`` (same prompt file, tasks, seed) with every expert
resident and, at every MoE layer ``l`` of every decode step, compares the router lookahead's
per-token top-k guess for layer ``l + d`` (that layer's router applied to the residual entering
layer ``l``, ``moe_runtime.layers.router_lookahead``) with the experts the token then really chose
there. Reported: per-token top-k precision (= recall, both sides pick k) for d = 1 .. ``--depth``,
and recall of the top-2k guess; chance is k / E. ``moeserve trace predict-eval`` gives the same
figure for EAMC matching (docs/tracer.md).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from moe_runtime.layers.router_lookahead import RouterLookahead
from moe_runtime.paths import shown_path


class _Probe(RouterLookahead):
    """Keeps each layer's per-token guesses; returns None so no policy is involved."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guesses: dict[int, torch.Tensor] = {}  # moe layer -> [T, D, E] probabilities

    def scores(
        self, x: torch.Tensor, moe_layer: int, normed: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        logits = self.logits(x, moe_layer)  # the residual's own normalisation, as documented
        if logits is not None:
            self.guesses[moe_layer] = logits
        return None


class _Truth:
    """Stands in for the tracer: keeps the routed top-k ids ``[T, k]`` of each MoE layer."""

    def __init__(self) -> None:
        self.ids: dict[int, np.ndarray] = {}
        self.decode: np.ndarray | None = None

    def record(self, layer, request_ids, token_seq, token_prefill, ids, weights) -> None:
        self.ids[layer] = ids
        self.decode = ~np.asarray(token_prefill)


def register_bench(sub: argparse._SubParsersAction) -> None:
    from moeserve.bench.policies import register_workload_args
    from moeserve.commands.common import add_model_arg

    p = sub.add_parser("lookahead", help="router lookahead: precision of its guess of later layers' experts")
    add_model_arg(p)
    register_workload_args(p)
    p.add_argument("--depth", type=int, default=3, help="later MoE layers guessed (default: 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from moe_runtime.engine.request import SamplingParams
    from moe_runtime.errors import ConfigError
    from moeserve.bench.policies import load_model_and_workload
    from moeserve.commands.common import resolve_model

    if args.depth < 1:
        raise ConfigError(f"--depth must be >= 1, got {args.depth}")
    torch.set_num_threads(1)
    model_dir = resolve_model(args)
    rt = RuntimeConfig(dtype="fp32", max_batch_size=args.batch, max_model_len=args.max_prompt_tokens + 64)
    loaded, warm, evals, tasks = load_model_and_workload(model_dir, rt, args, "lookahead")
    cfg = loaded.config
    k, e = cfg.top_k, cfg.num_experts
    hits = np.zeros((args.depth, 2))  # [d, (top-k, top-2k)] matched choices
    total = np.zeros(args.depth)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    with LLMEngine(loaded, rt) as engine:
        probe, truth = _Probe(cfg, loaded.dense, args.depth), _Truth()
        engine.model.lookahead, engine.model.recorder = probe, truth
        prompts = warm + evals
        for i in range(0, len(prompts), args.batch):
            for j, ids in enumerate(prompts[i : i + args.batch]):
                engine.add_request(f"r{i}-{j}", ids, params)
            while engine.has_unfinished():
                probe.guesses.clear()
                truth.ids.clear()
                engine.step()
                if truth.decode is None or not truth.decode.any():
                    continue
                dec = truth.decode
                for layer, guess in probe.guesses.items():
                    for d in range(guess.shape[1]):
                        actual = truth.ids[layer + 1 + d][dec]  # [t, k]
                        order = torch.argsort(guess[dec][:, d], dim=-1, descending=True).numpy()
                        for col, width in enumerate((k, 2 * k)):
                            picked = np.zeros((len(actual), e), dtype=bool)
                            np.put_along_axis(picked, order[:, :width], True, axis=1)
                            hits[d, col] += np.take_along_axis(picked, actual, axis=1).sum()
                        total[d] += actual.size
    prec = hits[:, 0] / np.maximum(total, 1)
    rec2k = hits[:, 1] / np.maximum(total, 1)
    settings = {
        "model": shown_path(model_dir),
        "num_moe_layers": cfg.num_moe_layers,
        "num_experts": e,
        "top_k": k,
        "tasks": tasks,
        "prompts": len(prompts),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "seed": args.seed,
        "chance_precision": k / e,
    }
    rows = [
        {
            "distance": d + 1,
            "topk_precision": float(prec[d]),
            "top2k_recall": float(rec2k[d]),
            "n": int(total[d]),
        }
        for d in range(args.depth)
    ]
    if args.json:
        print(json.dumps({"settings": settings, "results": rows}, indent=2))
    else:
        print("settings: " + ", ".join(f"{a}={b}" for a, b in settings.items()))
        for r in rows:
            print(
                f"distance {r['distance']}: top-{k} precision {r['topk_precision']:.3f}, "
                f"top-{2 * k} recall {r['top2k_recall']:.3f} over {r['n']} routed choices"
            )
    return 0
