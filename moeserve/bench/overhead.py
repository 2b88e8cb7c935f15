"""``moeserve bench overhead``: host work per MoE layer of the default policies, in microseconds.

What one MoE layer costs the compute thread on the host after its router's top-k ids reach the
host, with the ``eam`` row of ``moeserve bench policies`` (prefetch ``eam``, its cache policy,
``--cache-policy`` to pick another): the tracer's
``record``, the cache policy's ``after_routing`` (``buffer.after_routing``), the router
lookahead's host part (its ``[D, E]`` scores to numpy and ``observe_lookahead``; the matrix
product itself runs on the device) and the prefetch planning (``prefetcher.after_routing``). Issue
#15's budget is 50 us p50 at the Qwen3-30B-A3B shape (48 layers, 128 experts, top-8).

NOTE: the harness. The runtime's own objects (``RequestRecorder``, ``EAMC``, cache and prefetch
policies, ``Partition`` and ``TransferQueue``) are driven by the simulator (``moeserve.sim``)
on a seeded synthetic workload of the shape (group-structured routing, Gumbel top-k per token),
so the buffer's state evolves as in a run; every hook call is timed with ``perf_counter_ns`` and
summed per routed layer. The lookahead scores are the simulator's modelled router lookahead
(``SimConfig.lookahead_precision``), handed over as a ``torch`` tensor as the model does. The
first ``--warmup-steps`` steps of each repeat are dropped; each repeat starts from fresh objects,
its EAMC filled by ``--warm-requests`` requests first (the EAMC's default capacity, as a serving
run holds it once warm);
figures are the median over repeats with the min-max spread.

The EAMC term of a plan is weighed as the runtime weighs it (``--eamc-term weighed``, the
default: ``moe_runtime.prefetch.term_value``, its host time on this host's clock against its
measured gain times the simulated blocking per miss), or computed at every plan as the
simulator does (``always``: the figures before the term was weighed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from moe_runtime.layers.moe import start_host_copy
from moe_runtime.prefetch.term_value import TermValue
from moeserve.bench.policies import COMBOS
from tracer.eamc import DEFAULT_CAPACITY

HOOKS = ("record", "cache", "lookahead", "plan")
HOOKS_TOTAL = ("total", *HOOKS)
FIGURES = (*HOOKS_TOTAL, "planned_total")  # planned_total: the layers that predicted a plan
BUDGET_US = 50.0  # the target for p50 host work per MoE layer: well under a GPU layer's time
LOOKAHEAD_PRECISION = (0.647, 0.576, 0.493)  # bench lookahead, bundled model, d = 1..3 (timing only)
# the parts of a planning layer's ``plan`` figure (--sections): EAMC matching and the per-layer
# probabilities, the router lookahead's rows, the gain/cost test (their blend, ranking, victims:
# one compiled call that also orders the plan) and the queue update (TransferQueue.replan_ranked)
SECTIONS = {"predict": "_predict_rows", "lookahead": "_plan_rows", "gate": "_paying", "queue": "issue_ranked"}
EAM_CACHE = next(cache for label, _, cache, _ in COMBOS if label == "eam")  # the default row's cache
# the kinds of planning layer whose mix sets planned_total's p50 (``--eamc-term weighed`` only):
# the step's first plan (it pays the step's once-per-step work: the recorder's flush of the step
# before, the own term, the victims' use), the others that computed the EAMC term, and the rest
PLAN_KINDS = ("step_first", "term_in", "term_out")


class _Timer:
    """Per-hook durations (ns) of the current layer, summed into one row per routed layer."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []  # per routed layer: ns per hook (HOOKS order), planned, kind
        self._cur = [0, 0, 0, 0, 0]  # HOOKS, then the I/O side's work (not counted)
        self.section_rows: list[list[int]] = []  # per routed layer: ns per SECTIONS entry
        self._sections = [0] * len(SECTIONS)

    def wrap(self, index: int, fn: Any, section: bool = False) -> Any:
        """``fn`` timed into hook ``index`` (or, with ``section``, into ``SECTIONS`` entry ``index``)."""
        cur, clock = (self._sections if section else self._cur), time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[index] += clock() - t0

        return timed

    def close_layer(self, planned: bool, kind: int = -1) -> None:
        """End a routed layer; ``planned``: the prefetch policy predicted and tested a plan;
        ``kind``: its index in :data:`PLAN_KINDS` (-1: not told)."""
        self.rows.append([*self._cur[:4], int(planned), kind])
        self._cur[:] = [0, 0, 0, 0, 0]
        self.section_rows.append(self._sections[:])
        self._sections[:] = [0] * len(SECTIONS)


def measure(
    profile: str,
    hardware: str,
    batch: int,
    buffer_share: float,
    tokens: int,
    warm_requests: int,
    warmup_steps: int,
    lookahead: int,
    seed: int,
    cache: str = "eam-reuse",
    gate_open: bool = False,
    sections: bool = False,
    eamc_term: str = "weighed",
) -> dict[str, Any]:
    """One repeat: p50/p90 per hook and in total (us per routed layer), fresh objects.
    ``gate_open``: the cost-aware gate issues every candidate (``PrefetchGate.force_open``), so
    every layer plans, tests and issues. ``sections``: also time the parts of a plan
    (``SECTIONS``; their timers add to the ``plan`` figure) and return their p50 over the layers
    that planned as ``sections``. ``eamc_term``: ``weighed`` (as the runtime) or ``always``
    (as the simulator); the share of plans that computed the term is returned as
    ``eamc_term_share`` (1.0 with ``always``).

    Raises:
        ConfigError: unknown profile or hardware.
    """
    from moeserve.sim.cost import CostModel
    from moeserve.sim.engine import SimConfig, Simulator
    from moeserve.sim.hardware import get_hardware
    from moeserve.sim.models import get_model
    from moeserve.sim.speed import synthetic_workload

    model, hw = get_model(profile), get_hardware(hardware)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    wl = synthetic_workload(L, E, k, warm_requests + batch, tokens, seed=seed)
    warm, evals = wl.requests[:warm_requests], wl.requests[warm_requests:]
    slots = max(1, round(buffer_share * L * E))
    # the router lookahead's guesses (precision per distance: docs/results.md's bench lookahead)
    config = SimConfig(slots=slots, batch=batch, lookahead_precision=LOOKAHEAD_PRECISION[:lookahead])
    sim = Simulator(L, E, k, model.expert_bytes, CostModel.roofline(model, hw), config)
    timer = _Timer()
    terms: list[TermValue] = []
    eval_names = {r.request_id for r in evals}
    mark: list[int] = []  # routed layers before the first measured step
    window: list[tuple[int, int]] = []  # the EAMC term's (used, skipped) plans before the timed steps
    step_planned = [False]  # whether the current step planned yet (PLAN_KINDS: its first plan)
    orig_make_state, orig_step = sim.make_state, sim._step

    def make_state(*args: Any, **kwargs: Any) -> Any:
        state = orig_make_state(*args, **kwargs)
        pf, rec, buf = state.prefetcher, state.recorder, state.buffer
        if gate_open and pf.gate is not None:
            pf.gate.force_open = True
        if eamc_term == "weighed" and pf.gate is not None:  # the runtime's tests, on the host's clock
            pf.eamc_term = TermValue(pf.probe_every)
            terms.append(pf.eamc_term)
            pf._timed = True  # each plan's host time is measured (thread CPU time) for the gate
        if sections:
            for i, method in enumerate(SECTIONS.values()):
                setattr(pf, method, timer.wrap(i, getattr(pf, method), section=True))
        timed_record, ids_seen = timer.wrap(0, rec.record), []

        def record(layer: int, request_ids: list[str], *args: Any) -> None:
            ids_seen[:] = [args[2]]  # the layer's top-k ids [T, k], for the lookahead's copy
            timed_record(layer, request_ids, *args)

        rec.record = record
        for part in buf.parts:  # the cache policy itself: the simulator's clock replay is not host work
            part.policy.after_routing = timer.wrap(1, part.policy.after_routing)
        # The runtime copies the lookahead's scores to the host with the router's ids
        # (layers.moe._to_host: the scores' copy started, the ids' copy, the scores read): that
        # sequence runs here with the scores' parts and observe_lookahead timed. The tensors stand
        # for the router's and the lookahead's outputs, which the runtime has without this work,
        # and the ids' copy is paid at every layer with or without a lookahead: neither is timed.
        seen = pf.observe_lookahead
        start, read = timer.wrap(2, start_host_copy), timer.wrap(2, lambda layer, t: seen(layer, t.numpy()))

        def observe_lookahead(layer: int, s: np.ndarray) -> None:
            ahead, ids = torch.from_numpy(s), torch.from_numpy(ids_seen[0])
            pending = start(ahead)
            ids.cpu().numpy()
            read(layer, pending)

        pf.observe_lookahead = observe_lookahead
        # An idle link starting its next copy (victim choice included) is the I/O thread's work in
        # the runtime; inside a plan the simulator does it inline, so it is timed apart and removed.
        buf._start = timer.wrap(4, buf._start)
        plan, cur = timer.wrap(3, pf.after_routing), timer._cur

        def after_routing(layer: int, request_ids: list[str], topk_ids: np.ndarray) -> None:
            buf.advance()  # replay the clock to now first (the runtime's I/O thread did it already)
            io0, plans0, term = cur[4], pf.plans, pf.eamc_term
            used0 = term.used if term is not None else 0
            plan(layer, request_ids, topk_ids)
            cur[3] -= cur[4] - io0
            planned, kind = pf.plans > plans0, -1
            if planned and term is not None:
                kind = 0 if not step_planned[0] else 1 if term.used > used0 else 2
            step_planned[0] |= planned
            timer.close_layer(planned, kind)

        pf.after_routing = after_routing
        return state

    def step(state: Any, scheduled: list) -> None:
        if not mark and any(state.by_id[s.seq.request_id].request_id in eval_names for s in scheduled):
            mark.append(len(timer.rows))
        if mark and not window and len(timer.rows) >= mark[0] + warmup_steps * L:  # the timed steps start
            window.append((sum(t.used for t in terms), sum(t.skipped for t in terms)))
        step_planned[0] = False
        orig_step(state, scheduled)

    sim.make_state, sim._step = make_state, step
    t0 = time.perf_counter()
    sim.run("eam", cache, warm, evals)  # the warm part fills the EAMC; its layers are not counted
    wall = time.perf_counter() - t0
    table = np.asarray(timer.rows[mark[0] + warmup_steps * L :], dtype=np.float64)
    planned, kinds = table[:, 4] > 0, table[:, 5]
    rows = table[:, :4] / 1e3  # us
    if not len(rows):
        from moe_runtime.errors import ConfigError

        raise ConfigError(f"--tokens {tokens} leaves no step after --warmup-steps {warmup_steps}")
    total = rows.sum(axis=1)
    out: dict[str, Any] = {"layers_timed": len(rows), "wall_s": round(wall, 2)}
    for name, col in zip(("total", *HOOKS), (total, *rows.T), strict=True):
        out[name] = {"p50": float(np.percentile(col, 50)), "p90": float(np.percentile(col, 90))}
    # the layers that predicted a plan (all of them while prefetching pays; one in probe_every else)
    out["planned_share"] = float(planned.mean())
    # over the timed steps, as every other figure (the warm requests' plans left out)
    used0, skipped0 = window[0] if window else (0, 0)
    used, skipped = sum(t.used for t in terms) - used0, sum(t.skipped for t in terms) - skipped0
    out["eamc_term_share"] = used / max(1, used + skipped) if terms else 1.0
    full = total[planned] if planned.any() else total[:0]
    out["planned_total"] = {
        q: float(np.percentile(full, v)) if len(full) else 0.0 for q, v in (("p50", 50), ("p90", 90))
    }
    if terms and planned.any():  # the mix of planning layers: each kind's share and p50
        out["kinds"] = {
            name: {
                "share": float((kinds[planned] == i).mean()),
                "p50": float(np.percentile(total[kinds == i], 50)) if (kinds == i).any() else None,
            }
            for i, name in enumerate(PLAN_KINDS)
        }
    if sections and planned.any():
        parts = np.asarray(timer.section_rows[mark[0] + warmup_steps * L :], dtype=np.float64)[planned] / 1e3
        out["sections"] = {name: float(np.percentile(col, 50)) for name, col in zip(SECTIONS, parts.T)}
    return out


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overhead", help="host work per MoE layer of the default policies (us)")
    p.add_argument(
        "--model-profile", default="qwen3-30b-a3b", help="shape (moeserve simulate --list-profiles)"
    )
    p.add_argument(
        "--hardware", default="h100-80gb+pcie5", help="link and GPU profile for the buffer's clock"
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="running requests (default: 1 16)")
    p.add_argument(
        "--buffer", type=float, default=0.25, help="slots as a share of all experts (default: 0.25)"
    )
    p.add_argument("--tokens", type=int, default=24, help="decode tokens per measured request (default: 24)")
    p.add_argument(
        "--warm-requests",
        type=int,
        default=DEFAULT_CAPACITY,
        help=f"requests that fill the EAMC first (default: {DEFAULT_CAPACITY}, the EAMC's default "
        "capacity: a serving run's steady state)",
    )
    p.add_argument("--warmup-steps", type=int, default=4, help="measured steps dropped per repeat")
    p.add_argument("--lookahead", type=int, default=1, help="router lookahead depth (the default 1; 0 = off)")
    p.add_argument("--repeats", type=int, default=3, help="fresh repeats (>= 1; median and spread)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-policy", default=EAM_CACHE, help=f"cache policy (default: {EAM_CACHE})")
    p.add_argument(
        "--eamc-term",
        choices=("weighed", "always"),
        default="weighed",
        help="weigh the EAMC term's gain against its host time as the runtime does, or compute it "
        "at every plan as the simulator does (default: weighed)",
    )
    p.add_argument(
        "--sections",
        action="store_true",
        help="also time the parts of a planning layer (gate open; the timers add to its figures)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_runtime.errors import ConfigError

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 < args.buffer <= 1:
        raise ConfigError(f"--buffer must be in (0, 1], got {args.buffer}")
    if min(args.batch) < 1 or args.tokens < 1 or args.lookahead < 0 or args.warmup_steps < 0:
        raise ConfigError("--batch and --tokens must be >= 1, --lookahead and --warmup-steps >= 0")
    torch.set_num_threads(1)
    settings = {
        "model_profile": args.model_profile,
        "hardware": args.hardware,
        "policies": f"prefetch eam + cache {args.cache_policy}",
        "router_lookahead": args.lookahead,
        "eamc_term": args.eamc_term,
        "buffer": args.buffer,
        "tokens": args.tokens,
        "warm_requests": args.warm_requests,
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "seed": args.seed,
        "host": f"{platform.machine()}, {_cpus()} CPUs, python {platform.python_version()}",
        "numpy": np.__version__,
    }
    results = []
    for batch in args.batch:
        reps = [
            measure(
                args.model_profile,
                args.hardware,
                batch,
                args.buffer,
                args.tokens,
                args.warm_requests,
                args.warmup_steps,
                args.lookahead,
                args.seed + r,
                args.cache_policy,
                gate_open,
                args.sections and gate_open,
                args.eamc_term,
            )  # fmt: skip
            for gate_open in (False, True)
            for r in range(args.repeats)
        ]
        auto, forced = reps[: args.repeats], reps[args.repeats :]
        row: dict[str, Any] = {"batch": batch, "layers_timed": auto[0]["layers_timed"]}
        row["planned_share"] = round(statistics.median(r["planned_share"] for r in auto), 3)
        # the share of plans that computed the EAMC term, gate as is and open
        row["eamc_term_share"] = round(statistics.median(r["eamc_term_share"] for r in auto), 3)
        row["open_eamc_term_share"] = round(statistics.median(r["eamc_term_share"] for r in forced), 3)
        for prefix, runs, names in (("", auto, FIGURES), ("open_", forced, HOOKS_TOTAL)):
            for name in names:
                for q in ("p50", "p90"):
                    vals = [r[name][q] for r in runs]
                    row[f"{prefix}{name}_{q}_us"] = round(statistics.median(vals), 1)
                    row[f"{prefix}{name}_{q}_spread_us"] = [round(min(vals), 1), round(max(vals), 1)]
        if all("kinds" in r for r in auto):  # the mix behind planned_total (gate as is)
            row["planned_kinds"] = {
                name: {
                    "share": round(statistics.median(r["kinds"][name]["share"] for r in auto), 3),
                    "p50_us": _median_of([r["kinds"][name]["p50"] for r in auto]),
                }
                for name in PLAN_KINDS
            }
        if args.sections:  # p50 over the planning layers of the gate-open runs, median over repeats
            for name in SECTIONS:
                row[f"open_section_{name}_p50_us"] = round(
                    statistics.median(r["sections"][name] for r in forced), 1
                )
        row["budget_us"] = BUDGET_US
        # every layer must fit: the p50 over all layers, over the layers that plan, and with
        # the gate forced open (every layer plans and issues)
        for key in ("total", "planned_total", "open_total"):
            row[f"{key}_within_budget"] = row[f"{key}_p50_us"] <= BUDGET_US
        row["meets_budget"] = all(row[f"{k}_within_budget"] for k in ("total", "planned_total", "open_total"))
        results.append(row)
    if args.json:
        print(json.dumps({"settings": settings, "results": results}, indent=2))
        return 0
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print("us per routed MoE layer: median over repeats [min-max]")
    for r in results:
        for label, prefix, names in (("gate as is", "", FIGURES), ("gate open", "open_", HOOKS_TOTAL)):
            parts = [f"batch {r['batch']:>3} {label:<10}"]
            for name in names:
                lo, hi = r[f"{prefix}{name}_p50_spread_us"]
                p50, p90 = r[f"{prefix}{name}_p50_us"], r[f"{prefix}{name}_p90_us"]
                parts.append(f"{name} p50 {p50:.1f} [{lo:.1f}-{hi:.1f}] p90 {p90:.1f}")
            if not prefix:
                parts.append(f"planned {r['planned_share']:.0%} of layers")
            parts.append(f"EAMC term in {r[prefix + 'eamc_term_share']:.0%} of plans")
            print(" | ".join(parts))
            if not prefix and "planned_kinds" in r:
                kinds = r["planned_kinds"]
                parts = [f"batch {r['batch']:>3} planning layers by kind"]
                for name, label in zip(PLAN_KINDS, ("step's first", "EAMC term in", "term out"), strict=True):
                    p50 = kinds[name]["p50_us"]
                    shown = "-" if p50 is None else f"{p50:.1f}"
                    parts.append(f"{label} {kinds[name]['share']:.0%} p50 {shown}")
                print(" | ".join(parts))
        if args.sections:
            parts = [f"{name} p50 {r[f'open_section_{name}_p50_us']:.1f}" for name in SECTIONS]
            print(f"batch {r['batch']:>3} gate open, plan parts | " + " | ".join(parts))
        verdict = ", ".join(
            f"{key} {'within' if r[f'{key}_within_budget'] else 'over'}"
            for key in ("total", "planned_total", "open_total")
        )
        print(f"batch {r['batch']:>3} budget {BUDGET_US:.0f} us p50: {verdict}")
    return 0


def _median_of(values: list[float | None]) -> float | None:
    """Median of the repeats' figures that exist (a kind no planning layer had is None), rounded."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 1) if known else None


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
