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
