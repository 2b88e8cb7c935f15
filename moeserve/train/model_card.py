"""Generate ``docs/model-card.md`` (and ``docs/img/model-card-*.png``) for the bundled tiny MoE.

Every number in the card comes from the checkpoint folder (``config.json``, ``model.safetensors``,
``training_log.json``) or is measured here on the held-out split; nothing is typed by hand except
the paper's published figures (``routing_analysis.PAPER_TABLE1`` / ``PAPER_FIG2_MEAN``), cited.

Usage::

    moeserve train-tiny --card-only --out moe_runtime/assets/tiny-moe --card docs/model-card.md
    python -m moeserve.train.model_card --model moe_runtime/assets/tiny-moe --card docs/model-card.md
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moeserve.train import card_figures
from moeserve.train import corpus as C
from moeserve.train import routing_analysis as ra
from moeserve.train.corpus import DOMAINS, CorpusSplit
from moeserve.train.tokenizer import EOS_TOKEN

PROMPTS_PER_DOMAIN = 16
SHOWN_COMPLETIONS = 1  # per domain


def analyse(model_dir: Path, split: CorpusSplit, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Routing figures of the trained checkpoint and of the same architecture at random init."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from moeserve.train.shape import new_model
    from moeserve.train.trainer import encode_streams, eval_windows

    train_log = json.loads((model_dir / "training_log.json").read_text())
    s = train_log["settings"]
    torch.set_num_threads(s["threads"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    streams = encode_streams(tok, split.heldout, tok.token_to_id(EOS_TOKEN))
    windows = {d: eval_windows(streams[d], s["eval_windows"], s["seq_len"]) for d in DOMAINS}
    prompts = ra.pick_prompts(split.heldout, tok, PROMPTS_PER_DOMAIN)
    trained = Qwen3MoeForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    random_init = new_model(AutoConfig.from_pretrained(model_dir), s["seed"]).eval()
    cfg = trained.config
    out: dict[str, Any] = {
        "prompts": len(prompts),
        "num_experts": trained.config.num_experts,
        "top_k": trained.config.num_experts_per_tok,
    }
    traces = {}
    for name, model in (("trained", trained), ("random", random_init)):
        t0 = time.time()
        routed = {d: ra.window_routing(model, w) for d, w in windows.items()}
        traces[name] = [ra.trace_request(model, doc, ids) for doc, ids in prompts]
        out[name] = ra.summarise(traces[name], routed, cfg.num_experts, cfg.num_experts_per_tok)
        if name == "random":  # the same routers on the trained model's tokens (see routing_analysis)
            forced = [ra.forced_trace(model, t) for t in traces["trained"]]
            out["random_forced"] = ra.summarise(forced, routed, cfg.num_experts, cfg.num_experts_per_tok)
        log(f"analysed {name} model in {time.time() - t0:.0f} s")
    out["uniform"] = ra.uniform_reference(cfg.num_experts, cfg.num_experts_per_tok, traces["trained"])
    out["completions"] = []
    for domain in DOMAINS:
        for t in [t for t in traces["trained"] if t.domain == domain][:SHOWN_COMPLETIONS]:
            ids = (
                t.output_ids[: t.output_ids.index(cfg.eos_token_id)]
                if cfg.eos_token_id in t.output_ids
                else t.output_ids
            )
            out["completions"].append(
                {
                    "domain": domain,
                    "source": t.source,
                    "prompt": tok.decode(t.prompt_ids, skip_special_tokens=False),
                    "completion": tok.decode(ids, skip_special_tokens=False),
                }
            )
    return out


# --- markdown ------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _opt(value: float | None, fmt: Callable[[float], str]) -> str:
    return "-" if value is None else fmt(value)


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(
    model_dir: Path, log: dict[str, Any], a: dict[str, Any], imgs: dict[str, str], img_rel: str
) -> str:
    """The card's markdown text."""
    sh, st, p, t = log["shape"], log["settings"], log["params"], log["time_s"]
    size = (model_dir / "model.safetensors").stat().st_size
    tr = a["trained"]
    k, e = sh["top_k"], sh["num_experts"]
    lines = [
        "# Model card: `tiny-moe`, the bundled default model",
        "",
        "<!-- Generated; do not edit by hand. Regenerate with:",
        "     moeserve train-tiny --card-only --out moe_runtime/assets/tiny-moe --card docs/model-card.md",
        "     (or: python -m moeserve.train.model_card --model moe_runtime/assets/tiny-moe"
        " --card docs/model-card.md) -->",
        "",
        "Generated by `moeserve train-tiny --card-only --out moe_runtime/assets/tiny-moe --card "
        "docs/model-card.md` from the committed checkpoint and its `training_log.json`; routing figures are "
        "measured on the held-out split (rebuilt from `../shared/data`, or `--data-dir`).",
        "",
        "`moeserve serve` and `moeserve generate` run this model when `--model` is omitted "
        "(`moe_runtime.assets.default_model_dir()`). It is a small Qwen3-MoE trained by moeserve's own "
        "recipe (`moeserve train-tiny`, below) so that expert "
        "activation has the structure MoE-Infinity §3.1 relies on: experts specialised by domain, skewed "
        "reuse within a request, and correlation across layers. It is a routing test bed, not a useful "
        "language model.",
        "",
        "## Shape and size",
        "",
        _row("field", "value"),
        _row("---", "---"),
        _row("family", "`Qwen3MoeForCausalLM` (transformers reference implementation)"),
        _row("MoE layers", f"{sh['num_layers']} (every decoder layer; no shared expert)"),
        _row(
            "experts per layer / top-k",
            f"{e} / {k} (softmax, top-k renormalised; {_pct(k / e)} of a layer's experts per token)",
        ),
        _row("hidden / expert intermediate", f"{sh['hidden_size']} / {sh['moe_intermediate_size']}"),
        _row(
            "attention",
            f"{sh['num_heads']} heads x {sh['head_dim']}, {sh['num_kv_heads']} KV heads, q/k RMSNorm, RoPE",
        ),
        _row(
            "vocabulary / context", f"{sh['vocab_size']} (byte-level BPE) / {sh['max_position_embeddings']}"
        ),
        _row("embeddings", "tied" if sh["tie_word_embeddings"] else "untied"),
        _row("dtype / file", f"bfloat16 / `model.safetensors` {size / 2**20:.1f} MiB"),
        "",
        _row("parameters", "count", "share"),
        _row("---", "---:", "---:"),
        *[_row(name, f"{v:,}", _pct(v / p["total"])) for name, v in p.items()],
        "",
        "Expert tensors are stored per expert as transformers saves them: "
        "`model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`; "
        "router `model.layers.{i}.mlp.gate.weight`.",
        "",
        "## Chat template",
        "",
        f"`tokenizer_config.json` holds EOS `{EOS_TOKEN}` (also the pad token) and the jinja chat template "
        "(`chat_template`; its source is `CHAT_TEMPLATE` in `moeserve/train/tokenizer.py`). "
        "A conversation renders as `<|user|>\\n{message}\\n<|assistant|>\\n`; the role markers are single "
        f"special tokens. {C.CHAT_PERMILLE / 10:g} % of the QA training rows were rendered this way.",
        "",
        "With `tools` the template follows Qwen2.5/Qwen3 (Hermes): the tools are listed as JSON inside "
        "`<tools></tools>` in a `<|system|>` turn (after the system message, if any), a call is "
        '`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and tool results come back '
        "in a `<|user|>` turn as `<tool_response>` blocks; so the server parses calls out of the output "
        "(`server/routes/tool_calls.py`). No training row holds tools or calls: the model calls tools "
        'only under a grammar, with `tool_choice="required"` or a named function, which constrain its '
        "output to calls that match the tools' `parameters` and then end it "
        '(`finish_reason: "tool_calls"`). With `"auto"` it will rarely produce a call.',
        "",
        "## Training",
        "",
        "Command: `moeserve train-tiny --out moe_runtime/assets/tiny-moe "
        f"--steps {st['steps']} --seed {st['seed']} "
        f"--threads {st['threads']}` (recipe: `moeserve/train/`).",
        "",
        _row("setting", "value"),
        _row("---", "---"),
        _row("hyperparameters", ", ".join(f"{name} {v}" for name, v in st.items())),
        _row(
            "tokens seen",
            f"{log['tokens_seen']:,} ({st['batch_size'] // len(DOMAINS)} rows per domain per step)",
        ),
        _row("optimizer", "AdamW (0.9, 0.95), linear warm-up + cosine decay, clip 1.0"),
        _row(
            "load balancing",
            "per-layer Switch loss (see `trainer.py`), coefficient "
            f"{st['aux_loss_coef']}; final batch value {log['curve'][-1]['aux']:.3f} "
            "(1.0 = balanced)",
        ),
        _row(
            "time",
            f"data + tokenizer {t['data']:.0f} s, training {t['train']:.0f} s, "
            f"total {t['total'] / 60:.1f} min",
        ),
        _row("environment", ", ".join(f"{k_} {v}" for k_, v in log["environment"].items())),
        "",
        "### Corpus and split",
        "",
        "Domains: `code` (Python source of half of the stdlib files, tests excluded), "
        "`technical` (docstrings of the other half + `pydoc_data` topics), `literary` (Tiny Shakespeare), "
        f"`qa` (MMLU test rows after the first {C.REPLAYED_ROWS} per subject + dev rows; FLAN-v2 CoT rows "
        f"after the first {C.REPLAYED_ROWS} per set, at most {C.FLAN_ROWS_PER_SET:,} per set). The held-out "
        f"split is {C.HELDOUT_PERMILLE / 10:g} % of *sources* (a file, a topic, {C.SHAKESPEARE_GROUP} "
        "consecutive Shakespeare passages, a QA row) by a salted hash independent of the seed.",
        "",
        "No benchmark prompt is trained on: the QA row ids are checked disjoint from the ids in "
        "`prompts/prompts_combined.jsonl` and `prompts/prompts_extra.jsonl` "
        f"(which replay the first {C.REPLAYED_ROWS} rows), "
        f"and every document sharing a word {C.NGRAM}-gram with any replayed prompt is dropped; "
        "the final split is "
        "re-checked to have zero such overlap (`moeserve/train/corpus.py`, `tests/test_tiny_model.py`).",
        "",
        _row(
            "domain",
            "docs built",
            f"dropped ({C.NGRAM}-gram overlap)",
            "train docs / sources",
            "train chars",
            "train tokens",
            "held-out docs / sources",
            "held-out tokens",
        ),
        _row(*["---"] * 8),
        *[
            _row(
                d,
                c["docs_built"],
                c["docs_dropped_overlap"],
                f"{c['train_docs']} / {c['train_sources']}",
                f"{c['train_chars']:,}",
                f"{log['train_tokens_per_domain'][d]:,}",
                f"{c['heldout_docs']} / {c['heldout_sources']}",
                f"{log['heldout_tokens_per_domain'][d]:,}",
            )
            for d, c in log["corpus"].items()
        ],
        "",
        f"![training curve]({img_rel}/{imgs['training']})",
        "",
        "Held-out next-token loss (nats/token) on "
        f"{st['eval_windows']} fixed windows of {st['seq_len']} tokens per domain:",
        "",
        _row(
            "domain",
            "random init (step 0)",
            f"step {log['evals'][-1]['step']} (fp32)",
            "committed bf16 checkpoint",
        ),
        _row("---", "---:", "---:", "---:"),
        *[
            _row(d, f"{log['evals'][0][d]:.3f}", f"{log['evals'][-1][d]:.3f}", f"{tr['heldout_loss'][d]:.3f}")
            for d in DOMAINS
        ],
        "",
        *_routing_section(a, imgs, img_rel),
        *_completions_section(a["completions"]),
    ]
    lines += [
        "## Limitations",
        "",
        f"- About {log['tokens_seen'] / 1e6:.1f} M training tokens, a recipe sized for a CPU: the text it "
        "writes is locally plausible at best. Use it to exercise routing, offloading and prefetching, "
        "not for answers.",
        "- The domains are few and far apart, so specialisation is coarser than in a large MoE; the batch "
        "ratios of a real serving mix depend on how similar concurrent requests are.",
        "",
    ]
    return "\n".join(lines)


def _completions_section(completions: list[dict]) -> list[str]:
    """The greedy completions as one text block: per held-out prompt its domain and source, the
    prompt's last 400 characters and the completion, each a JSON string (newlines as ``\\n``)."""
    lines = ["## Greedy completions (held-out prompts, trained model)", "", "~~~text"]
    for c in completions:
        prompt = c["prompt"] if len(c["prompt"]) <= 400 else "..." + c["prompt"][-400:]
        lines += [
            f"{c['domain']} ({c['source']})",
            f"  prompt:     {json.dumps(prompt, ensure_ascii=False)}",
            f"  completion: {json.dumps(c['completion'], ensure_ascii=False)}",
        ]
    return [*lines, "~~~", ""]


MODELS = ("trained", "random", "random_forced")
MODEL_LABELS = {
    "trained": "trained",
    "random": "random init",
    "random_forced": "random init, trained model's tokens",
}


def _than(x: float, y: float) -> str:
    return "higher than" if x > y else "lower than" if x < y else "equal to"


def _reading(a: dict[str, Any]) -> list[str]:
    """A generated paragraph reading the routing table (every comparison is computed)."""
    tr, rn, rf, un = a["trained"], a["random"], a["random_forced"], a["uniform"]
    rf_share = rf["decode_top25_share_per_layer"]
    trend = "rising with depth" if rf_share[-1] > rf_share[0] else "not rising with depth"
    return [
        "Reading the table: random init is not uniform routing. On the same tokens as the trained model, "
        f"its routers concentrate a request on few experts ({trend}: top-25 % share {_pct(rf_share[0])} in "
        f"the first layer, {_pct(rf_share[-1])} in the last), so its low activation ratios come from "
        "routers that barely depend on the token, not from specialisation. "
        "The trained model routes token by token (a request touches "
        f"{_pct(np.mean(tr['decode_ratio']))} of a layer's experts over {ra.DECODE_STEPS} decode iterations, "
        f"vs. {_pct(np.mean(rf['decode_ratio']))}), its domains diverge "
        f"{tr['jsd_mean'] / max(rn['jsd_mean'], 1e-12):.1f}x as much (JSD), its adjacent-layer NMI is "
        f"{_than(np.mean(tr['adjacent_layer_nmi']), np.mean(rn['adjacent_layer_nmi']))} random init's, and "
        f"within a request its top 25 % experts still take {_pct(tr['decode_top25_share'])} of the "
        f"activations, against {_pct(un['decode_top25_share'])} under uniform routing.",
        "",
    ]


def _routing_section(a: dict[str, Any], imgs: dict[str, str], img_rel: str) -> list[str]:
    """Markdown of the routing comparison (trained vs. random init vs. uniform routing)."""
    tr, rn, un = a["trained"], a["random"], a["uniform"]
    e, k = a["num_experts"], a["top_k"]
    n_layers = len(tr["jsd_per_layer"])

    def per_model(fmt, key, uniform: str = "") -> list[str]:
        return [fmt(a[m][key]) for m in MODELS] + [uniform]

    mean_pct = lambda v: _pct(np.mean(v))
    mean_3 = lambda v: f"{np.mean(v):.3f}"
    uniform_32 = lambda e_, k_: ra.uniform_ratio(e_, k_, 32)
    return [
        "## Routing structure on held-out text (trained vs. random init)",
        "",
        f"Same architecture and seed at random init vs. the trained checkpoint; {a['prompts']} held-out "
        f"requests ({PROMPTS_PER_DOMAIN} per domain; QA prompts end where the answer starts, others are cut "
        f"to {'/'.join(map(str, ra.PROMPT_LENGTHS))} tokens), each decoded greedily for {ra.DECODE_STEPS} "
        "iterations (EOS ignored). A random-init model's greedy output soon repeats one token, so decode "
        "figures are also given for the random-init routers on the trained model's tokens (teacher-forced: "
        "same token stream, only the routers differ). JSD, NMI and expert load use the held-out loss "
        "windows. Definitions: `moeserve/train/routing_analysis.py`.",
        "",
        _row("measure", *[MODEL_LABELS[m] for m in MODELS], "uniform routing"),
        _row("---", "---:", "---:", "---:", "---:"),
        _row(
            "domain JSD, mean over layers and domain pairs (bits)",
            *per_model(lambda v: f"{v:.3f}", "jsd_mean", "0"),
        ),
        _row("adjacent-layer NMI of top-1 experts, mean", *per_model(mean_3, "adjacent_layer_nmi", "0")),
        _row(
            f"distinct tokens among the {ra.DECODE_STEPS} output tokens, mean",
            *per_model(lambda v: f"{np.mean(v):.1f}", "distinct_output_tokens"),
        ),
        _row(
            "decode: share of a request's activations on its top 25 % experts "
            f"({ra.DECODE_STEPS} iterations)",
            *per_model(_pct, "decode_top25_share", _pct(un["decode_top25_share"])),
        ),
        _row(
            f"decode activation ratio per request over {ra.DECODE_STEPS} iterations, mean",
            *per_model(mean_pct, "decode_ratio", _pct(un["decode_ratio"])),
        ),
        _row(
            "prefill activation ratio per request, mean",
            *per_model(mean_pct, "prefill_ratio", mean_pct(un["prefill_ratio"])),
        ),
        _row(
            "expert load: least / most used expert (x uniform share), over layers",
            *[f"{min(a[m]['expert_load_min']):.2f} / {max(a[m]['expert_load_max']):.2f}" for m in MODELS[:2]],
            "",
            "1.00 / 1.00",
        ),
        _row(
            "experts under 0.1x the uniform share, most in one layer",
            *[str(max(a[m]["experts_below_tenth_share"])) for m in MODELS[:2]],
            "",
            "0",
        ),
        "",
        _row("MoE layer", *range(n_layers)),
        _row("---", *["---:"] * n_layers),
        _row("JSD trained", *[f"{v:.3f}" for v in tr["jsd_per_layer"]]),
        _row("JSD random init", *[f"{v:.3f}" for v in rn["jsd_per_layer"]]),
        _row("NMI(l, l+1) trained", *[f"{v:.3f}" for v in tr["adjacent_layer_nmi"]], ""),
        _row("NMI(l, l+1) random init", *[f"{v:.3f}" for v in rn["adjacent_layer_nmi"]], ""),
        *[
            _row(
                f"top-25 % share, {MODEL_LABELS[m]}", *[_pct(v) for v in a[m]["decode_top25_share_per_layer"]]
            )
            for m in MODELS
        ],
        _row("expert load max (x uniform), trained", *[f"{v:.2f}" for v in tr["expert_load_max"]]),
        _row("experts under 0.1x uniform, trained", *tr["experts_below_tenth_share"]),
        "",
        "Domain pairs (JSD, mean over layers): "
        + ", ".join(
            f"{pair} {v:.3f} (random {rn['jsd_pairs'][pair]:.3f})" for pair, v in tr["jsd_pairs"].items()
        )
        + ". Decode top-25 % share by domain (trained): "
        + ", ".join(f"{d} {_pct(v)}" for d, v in tr["decode_top25_share_by_domain"].items())
        + ".",
        "",
        f"![routing]({img_rel}/{imgs['routing']})",
        "",
        *_reading(a),
        "### Activation ratios vs. MoE-Infinity Table 1 and Figure 2",
        "",
        "Per decode iteration, the share (%) of a layer's experts that a batch of `bs` concurrent held-out "
        "requests uses (the paper's Table 1 measure). Paper rows are its published figures for much larger "
        "models; the last column divides the bs=32 figure by what uniform routing with the same experts "
        "and top-k would give, which puts models with different E and k on one scale:",
        "",
        _row("model (experts, top-k)", *[f"bs={b}" for b in ra.BATCH_SIZES], "bs=32 / uniform"),
        _row("---", *["---:"] * 7),
        *[
            _row(
                f"{name} ({e_}, top-{k_}) [paper]",
                *[f"{v:.1f}" for v in vals],
                f"{vals[-1] / 100 / uniform_32(e_, k_):.2f}",
            )
            for name, (e_, k_, vals) in ra.PAPER_TABLE1.items()
        ],
        *[
            _row(
                f"tiny-moe {MODEL_LABELS.get(name, name)} ({e}, top-{k})",
                *[_opt(a[name]["batch_ratio"].get(b), lambda v: f"{100 * v:.1f}") for b in ra.BATCH_SIZES],
                _opt(a[name]["batch_ratio"].get(32), lambda v: f"{v / uniform_32(e, k):.2f}"),
            )
            for name in (*MODELS, "uniform")
        ],
        "",
        f"![batch ratio]({img_rel}/{imgs['batch']})",
        "",
        f"Prefill (Figure 2): the trained model touches {mean_pct(tr['prefill_ratio'])} of a layer's experts "
        f"per request on average (prompts of {np.mean(tr['prompt_len']):.0f} tokens on average), against "
        + ", ".join(f"{v:g} % for {n}" for n, v in ra.PAPER_FIG2_MEAN.items())
        + f" in the paper (128 experts, top-1/top-2); random init {mean_pct(rn['prefill_ratio'])}, uniform "
        f"routing {mean_pct(un['prefill_ratio'])}.",
        "",
        f"![prefill ratio]({img_rel}/{imgs['prefill']})",
        "",
    ]


def write_card(model_dir: Path, split: CorpusSplit, card: Path, log: Callable[[str], None] = print) -> dict:
    """Analyse ``model_dir`` and write ``card`` plus ``<card dir>/img/model-card-*.png``."""
    model_dir, card = Path(model_dir), Path(card)
    train_log = json.loads((model_dir / "training_log.json").read_text())
    analysis = analyse(model_dir, split, log)
    imgs = card_figures.plot_all(train_log, analysis, card.parent / "img")
    card.parent.mkdir(parents=True, exist_ok=True)
    card.write_text(render(model_dir, train_log, analysis, imgs, "img"))
    return analysis


def main(argv: list[str] | None = None) -> int:
    from moeserve.train.corpus import build_corpus

    p = argparse.ArgumentParser(description="write the tiny MoE's model card")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--card", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, default=None)
    args = p.parse_args(argv)
    write_card(args.model, build_corpus(args.data_dir), args.card)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
