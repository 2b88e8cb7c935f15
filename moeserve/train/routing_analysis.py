"""Routing statistics of a Qwen3-MoE on held-out text: is expert activation *structured*?

MoE-Infinity (§3.1) builds on three observations about trained MoEs, each measured here for the
trained model and for the same architecture at random init (same seed), on held-out text only:

1. *Specialisation / group activation*: experts are trained to serve groups of inputs, so domains
   use different experts. Measured as the per-layer Jensen–Shannon divergence (base 2, in [0, 1])
   between the domains' expert-activation distributions, averaged over domain pairs; plus the
   normalised mutual information of adjacent layers' top-1 experts (cross-layer correlation).
2. *Skewed reuse within a request*: over 32 greedy decode iterations, the share of a request's
   expert activations (per layer) that its top 25 % experts cover. Uniform routing gives a floor,
   estimated by Monte Carlo with the same k, E and token count.
3. *Low activation ratios*: the share of a layer's experts a request touches during prefill (vs.
   prompt length, Figure 2) and during 32 decode iterations, and the per-iteration ratio of a decode
   batch of ``bs`` requests (Table 1), next to the uniform-routing expectation ``1 - (1 - k/E)^n``.

NOTE: a random-init model decoding greedily soon repeats one token, which makes its decode routing
trivially concentrated. So the decode measures are also taken for the random-init model *on the
trained model's tokens* (:func:`forced_trace`: one forward over prompt + the trained model's 32
tokens), which compares the routers on identical token streams.

Routing is read from transformers' router logits (``output_router_logits=True``): top-k of the
softmax, the same selection our runtime makes. Decoding ignores EOS so every request has exactly
:data:`DECODE_STEPS` decode iterations.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeserve.train.corpus import DOMAINS, Doc

DECODE_STEPS = 32
PROMPT_LENGTHS: tuple[int, ...] = (16, 32, 64, 128, 256)  # tokens; cycled over non-QA prompts
BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
TOP_SHARE = 0.25
QA_MARKERS: tuple[str, ...] = ("<|assistant|>\n", "\nAnswer:")
# MoE-Infinity (shared/papers/003), Table 1: expert activation ratio (%) per decode iteration by batch size,
# with (experts per layer, top-k) of each model.
PAPER_TABLE1: dict[str, tuple[int, int, tuple[float, ...]]] = {
    "Switch-128x0.2B": (128, 1, (1.2, 1.8, 2.7, 3.9, 5.6, 7.8)),
    "NLLB-128x0.4B": (128, 2, (3.6, 5.3, 7.6, 10.6, 14.7, 19.9)),
    "Arctic-128x4B": (128, 2, (1.5, 2.7, 4.5, 6.9, 10.2, 14.5)),
    "Mixtral-8x7B": (8, 2, (25.0, 42.9, 66.0, 86.4, 96.7, 99.3)),
}
# MoE-Infinity §3.1 / Figure 2: mean prefill activation ratio (%) over BIGBench, FLAN and MMLU prompts.
PAPER_FIG2_MEAN: dict[str, float] = {"NLLB-128x0.4B": 26.0, "Switch-128x0.2B": 21.0}


@dataclass(slots=True)
class RequestTrace:
    """One held-out request: prompt, greedy output and the experts each token was routed to.

    ``prefill``: ``[L, P, k]`` expert ids of the prompt tokens; ``decode``: ``[L, D, k]`` of the
    ``D`` decode iterations (each feeds the previous greedy token).
    """

    domain: str
    source: str
    prompt_ids: list[int]
    output_ids: list[int]
    prefill: np.ndarray
    decode: np.ndarray


def route_ids(router_logits: tuple[torch.Tensor, ...], top_k: int) -> np.ndarray:
    """Top-k expert ids per layer and token: tuple of ``[N, E]`` logits -> ``[L, N, k]`` int16."""
    return np.stack([lg.float().topk(top_k, dim=-1).indices.numpy() for lg in router_logits]).astype(np.int16)


def _prompt_text_and_len(doc: Doc, i: int) -> tuple[str, int | None]:
    """QA prompts end where the answer starts; others are cut to a cycled token length."""
    if doc.domain == "qa":
        for marker in QA_MARKERS:
            if marker in doc.text:
                cut = doc.text.index(marker) + len(marker)
                return doc.text[:cut], None
    return doc.text, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]


def pick_prompts(heldout: dict[str, list[Doc]], tok, per_domain: int) -> list[tuple[Doc, list[int]]]:
    """``per_domain`` held-out prompts per domain, docs spread evenly over each domain's list."""
    out = []
    for domain in DOMAINS:
        docs = heldout[domain]
        picks = np.linspace(0, len(docs) - 1, num=min(per_domain, len(docs))).astype(int)
        for i, j in enumerate(picks):
            text, length = _prompt_text_and_len(docs[j], i)
            ids = tok.encode(text).ids
            out.append((docs[j], ids[:length] if length else ids[-512:]))
    return out


@torch.no_grad()
def trace_request(model, doc: Doc, prompt_ids: list[int], steps: int = DECODE_STEPS) -> RequestTrace:
    """Prefill ``prompt_ids`` then ``steps`` greedy decode iterations, recording the routing."""
    k = model.config.num_experts_per_tok
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, output_router_logits=True)
    prefill = route_ids(out.router_logits, k)
    cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    outputs, decode = [token], []
    for _ in range(steps):
        out = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=cache,
            use_cache=True,
            output_router_logits=True,
        )
        decode.append(route_ids(out.router_logits, k))
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        outputs.append(token)
    return RequestTrace(
        doc.domain, doc.source, list(prompt_ids), outputs[:steps], prefill, np.concatenate(decode, axis=1)
    )


@torch.no_grad()
def forced_trace(model, trace: RequestTrace) -> RequestTrace:
    """Routing of ``model`` on ``trace``'s prompt and output tokens (teacher-forced, one forward).

    Decode iteration ``i`` feeds output token ``i``, so its routing is that of position ``P + i``.
    """
    ids = trace.prompt_ids + trace.output_ids
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    routed = route_ids(out.router_logits, model.config.num_experts_per_tok)  # [L, P + D, k]
    p = len(trace.prompt_ids)
    return RequestTrace(
        trace.domain, trace.source, trace.prompt_ids, trace.output_ids, routed[:, :p], routed[:, p:]
    )


@torch.no_grad()
def window_routing(model, windows: torch.Tensor, chunk: int = 8) -> tuple[np.ndarray, float]:
    """Routing and mean next-token loss of held-out windows ``[n, T + 1]`` -> (``[L, n*T, k]``, nats)."""
    k = model.config.num_experts_per_tok
    ids, total = [], 0.0
    for i in range(0, len(windows), chunk):
        x = windows[i : i + chunk]
        out = model(input_ids=x[:, :-1], use_cache=False, output_router_logits=True)
        ids.append(route_ids(out.router_logits, k))
        total += torch.nn.functional.cross_entropy(
            out.logits.float().reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        ).item()
    return np.concatenate(ids, axis=1), total / windows[:, 1:].numel()


# --- metrics -------------------------------------------------------------------------------------


def counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Per-layer activation counts (an EAM): ``[L, N, k]`` ids -> ``[L, E]``."""
    return np.stack([np.bincount(layer.ravel(), minlength=num_experts) for layer in ids])


def jsd(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen–Shannon divergence of two distributions, base 2 (0 = same, 1 = disjoint)."""
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / m[nz])).sum())

    return 0.5 * kl(p) + 0.5 * kl(q)


def domain_jsd(eams: dict[str, np.ndarray]) -> tuple[list[float], dict[str, float]]:
    """Per-layer JSD averaged over domain pairs, and per pair averaged over layers."""
    pairs = list(itertools.combinations(sorted(eams), 2))
    num_layers = len(next(iter(eams.values())))
    per_pair = {f"{a}/{b}": [jsd(eams[a][i], eams[b][i]) for i in range(num_layers)] for a, b in pairs}
    per_layer = [float(np.mean([v[i] for v in per_pair.values()])) for i in range(num_layers)]
    return per_layer, {k: float(np.mean(v)) for k, v in per_pair.items()}


def top_share(eam: np.ndarray, frac: float = TOP_SHARE) -> np.ndarray:
    """Per layer, the share of activations covered by the top ``frac`` experts. ``[L, E]`` -> ``[L]``."""
    top = max(1, int(round(frac * eam.shape[1])))
    ordered = -np.sort(-eam, axis=1)
    return ordered[:, :top].sum(1) / np.maximum(eam.sum(1), 1)


def uniform_top_share(num_experts: int, top_k: int, tokens: int, trials: int = 2000, seed: int = 0) -> float:
    """Monte-Carlo :func:`top_share` when every token picks ``top_k`` distinct experts uniformly."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((trials, tokens, num_experts)), axis=-1)[..., :top_k]
    eams = np.stack([np.bincount(t.ravel(), minlength=num_experts) for t in picks])
    return float(top_share(eams).mean())


def activation_ratio(ids: np.ndarray, num_experts: int) -> float:
    """Share of (layer, expert) pairs used at least once by ``[L, N, k]`` ids."""
    return float(np.mean([len(np.unique(layer)) / num_experts for layer in ids]))


def uniform_ratio(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected activation ratio of ``tokens`` independent uniform top-k choices."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def batch_ratio(traces: list[RequestTrace], bs: int, num_experts: int, seed: int = 0) -> float:
    """Table-1 ratio: share of a layer's experts one decode iteration of ``bs`` requests uses.

    Requests are grouped into batches of ``bs`` (seeded shuffle); per decode iteration and layer the
    union of the batch's experts is counted; averaged over iterations, layers and batches.
    """
    order = np.random.default_rng(seed).permutation(len(traces))
    ratios = []
    for start in range(0, len(order) - bs + 1, bs):
        batch = np.concatenate([traces[i].decode for i in order[start : start + bs]], axis=2)  # [L, D, bs*k]
        for layer in batch:
            ratios += [len(np.unique(step)) / num_experts for step in layer]
    return float(np.mean(ratios))


def adjacent_layer_nmi(ids: np.ndarray) -> list[float]:
    """Normalised mutual information of layer ``l`` and ``l + 1`` top-1 experts over tokens."""
    out = []
    for a, b in itertools.pairwise(ids[:, :, 0]):
        joint = np.zeros((int(ids.max()) + 1,) * 2)
        np.add.at(joint, (a, b), 1)
        joint /= joint.sum()
        pa, pb = joint.sum(1), joint.sum(0)
        nz = joint > 0
        mi = float((joint[nz] * np.log(joint[nz] / np.outer(pa, pb)[nz])).sum())

        def ent(p: np.ndarray) -> float:
            return float(-(p[p > 0] * np.log(p[p > 0])).sum())

        out.append(mi / max(np.sqrt(ent(pa) * ent(pb)), 1e-12))
    return out


def summarise(
    traces: list[RequestTrace], windows: dict[str, tuple[np.ndarray, float]], num_experts: int, top_k: int
) -> dict[str, Any]:
    """All routing figures of one model (see the module docstring)."""
    eams = {d: counts(ids, num_experts) for d, (ids, _) in windows.items()}
    jsd_layers, jsd_pairs = domain_jsd(eams)
    total = sum(eams.values())
    load = total / total.sum(1, keepdims=True) * num_experts  # 1.0 = uniform share
    all_ids = np.concatenate([ids for ids, _ in windows.values()], axis=1)
    skew = np.stack([top_share(counts(t.decode, num_experts)) for t in traces])  # [R, L]
    return {
        "heldout_loss": {d: loss for d, (_, loss) in windows.items()},
        "jsd_per_layer": jsd_layers,
        "jsd_mean": float(np.mean(jsd_layers)),
        "jsd_pairs": jsd_pairs,
        "adjacent_layer_nmi": adjacent_layer_nmi(all_ids),
        "expert_load_min": load.min(1).tolist(),
        "expert_load_max": load.max(1).tolist(),
        "experts_below_tenth_share": (load < 0.1).sum(1).tolist(),
        "decode_top25_share_per_layer": skew.mean(0).tolist(),
        "decode_top25_share": float(skew.mean()),
        "decode_top25_share_by_domain": {
            d: float(np.mean([s.mean() for s, t in zip(skew, traces, strict=True) if t.domain == d]))
            for d in DOMAINS
        },
        "prefill_ratio": [activation_ratio(t.prefill, num_experts) for t in traces],
        "prompt_len": [len(t.prompt_ids) for t in traces],
        "decode_ratio": [activation_ratio(t.decode, num_experts) for t in traces],
        "distinct_output_tokens": [len(set(t.output_ids)) for t in traces],
        "batch_ratio": {bs: batch_ratio(traces, bs, num_experts) for bs in BATCH_SIZES if bs <= len(traces)},
    }


def uniform_reference(num_experts: int, top_k: int, traces: list[RequestTrace]) -> dict[str, Any]:
    """What uniform, structure-free routing would give for the same requests."""
    return {
        "decode_top25_share": uniform_top_share(num_experts, top_k, DECODE_STEPS),
        "decode_ratio": uniform_ratio(num_experts, top_k, DECODE_STEPS),
        "prefill_ratio": [uniform_ratio(num_experts, top_k, len(t.prompt_ids)) for t in traces],
        "batch_ratio": {bs: uniform_ratio(num_experts, top_k, bs) for bs in BATCH_SIZES},
    }
