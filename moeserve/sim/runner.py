"""Run policy combinations through the simulator, the way ``moeserve bench policies`` runs them.

The combinations (prefetch policy + cache policy) are the benchmark's own list
(:data:`moeserve.bench.policies.COMBOS`, rows ``(label, prefetch, cache, runtime overrides)``).
The overrides' ``router_lookahead`` is honoured when the simulator models the router lookahead
(``SimConfig.lookahead_precision``); without it a routing replay has no residual stream to look
ahead on and a row is the pair of policies alone. The oracle replays the expert-access log of the
on-demand run's eval part (MoE-Infinity Table 5's "Ideal"), so on-demand always runs first.
"""

from __future__ import annotations

from moe_runtime.errors import ConfigError
from moe_runtime.prefetch import PREFETCH_POLICIES
from moeserve.bench.policies import COMBOS
from moeserve.sim.engine import PolicyRun, Simulator
from moeserve.sim.workload import SimRequest

SIM_COMBOS: list[tuple[str, str, str]] = [(label, p, c) for label, p, c, *_ in COMBOS]
LOOKAHEAD = {label: o["router_lookahead"] for label, _, _, o in COMBOS if "router_lookahead" in o}
PAIRED_CACHE = {prefetch: cache for _, prefetch, cache in SIM_COMBOS}


def combo_for(prefetch: str, cache: str | None) -> tuple[str, str, str]:
    """``(label, prefetch, cache)``; the cache defaults to the benchmark's pairing (``eam`` with
    ``eam``, ``model-counts`` with ``model-counts``, ``oracle`` with ``oracle``, else ``lru``).

    Raises:
        ConfigError: unknown prefetch policy.
    """
    if prefetch not in PREFETCH_POLICIES:
        raise ConfigError(f"--policy {prefetch!r} is unknown (choose from {', '.join(PREFETCH_POLICIES)})")
    cache = cache or PAIRED_CACHE.get(prefetch, "lru")
    for label, p, c in SIM_COMBOS:
        if (p, c) == (prefetch, cache):
            return label, p, c
    return f"{prefetch}+{cache}", prefetch, cache


def run_combos(
    sim: Simulator,
    combos: list[tuple],
    warm: list[SimRequest],
    evals: list[SimRequest],
) -> list[PolicyRun]:
    """Run each ``(label, prefetch, cache, ...)`` (a bench row's ``router_lookahead`` override is
    honoured, other fields ignored); on-demand+lru runs first
    when the oracle is asked for (its eval access log is the oracle's future) and is reported only if
    asked for too."""
    wanted = [tuple(c[:3]) for c in combos]
    needs_log = any(p == "oracle" or c == "oracle" for _, p, c in wanted)
    base = SIM_COMBOS[0]
    order = ([base] if needs_log and base not in wanted else []) + [c for c in wanted if c == base]
    order += [c for c in wanted if c != base]
    runs: dict[tuple[str, str, str], PolicyRun] = {}
    log = None
    for combo in order:
        label, prefetch, cache = combo
        uses_oracle = prefetch == "oracle" or cache == "oracle"
        run = sim.run(
            prefetch,
            cache,
            warm,
            evals,
            oracle_log=log if uses_oracle else None,
            record_log=combo == base,
            label=label,
            lookahead=LOOKAHEAD.get(label),
        )
        if combo == base:
            log = run.access_log
        runs[combo] = run
    return [runs[c] for c in wanted]


def run_modes(
    sim: Simulator,
    combos: list[tuple],
    modes: list[str],
    warm: list[SimRequest],
    evals: list[SimRequest],
    prefill_tokens: int = 0,
    pool: list[SimRequest] | None = None,
) -> list[PolicyRun]:
    """:func:`run_combos` once per ``--expert-compute`` mode (``sim.config.hybrid`` gives the
    lanes and the CPU's cost): ``device`` runs ``combos``; ``cpu`` one row, ``cpu`` (its policies
    are fixed: no prefetch, LRU over a fixed set); ``auto`` ``combos`` but the oracle (whose
    schedule replays a fetch-only run), labelled ``LABEL (auto)``. With ``prefill_tokens``, every
    row but the oracle runs again with a prompt of that many rows before each measured request
    (:func:`~moeserve.sim.workload.with_prompts` over ``pool``), and its ``hybrid["prefill"]``
    counts are that run's prefill steps'."""
    from dataclasses import replace

    from moeserve.sim.workload import with_prompts

    base = sim.config.hybrid
    if base is None:
        raise ConfigError("--expert-compute needs a host profile (hybrid settings)")
    prompted = with_prompts(evals, prefill_tokens, pool or evals) if prefill_tokens else None
    out: list[PolicyRun] = []
    for mode in modes:
        cfg = replace(sim.config, hybrid=replace(base, mode=mode))
        s = Simulator(sim.L, sim.E, sim.k, sim.expert_bytes, sim.cost, cfg)
        if mode == "cpu":
            rows: list[tuple] = [("cpu", "on-demand", "lru")]
        elif mode == "auto":
            rows = [c for c in combos if "oracle" not in c[1:3]]
        else:
            rows = list(combos)
        runs = run_combos(s, rows, warm, evals)
        for run, row in zip(runs, rows):
            if mode == "auto":
                run.label = f"{run.label} (auto)"
            if prompted is not None and "oracle" not in row[1:3]:
                la = LOOKAHEAD.get(row[0])
                again = s.run(row[1], row[2], warm, prompted, label=run.label, lookahead=la)
                run.hybrid["prefill"] = again.hybrid["prefill"]
        out += runs
    return out
