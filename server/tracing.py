"""Tracer plumbing for the server: build the recorder, save the EAMC, expose EAMC figures.

The EAMC (MoE-Infinity §4.2) fills online: the tracer's recorder commits each finished request's
EAM to it on the engine thread. The server saves it every ``--eamc-save-every`` finished requests
(from the engine thread, between steps, so no step mutates it meanwhile) and once more at
shutdown after the engine thread stopped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moe_runtime.errors import ConfigError

log = logging.getLogger("moeserve.server")


class TraceHooks:
    """Periodic and final EAMC saves plus the figures ``/metrics`` reads.

    Args:
        engine: the engine (its ``stats.requests_finished`` counts finished requests; its
            ``eamc`` attribute, when present, is the collection to save and report).
        eamc_path: where to save the EAMC (``eamc.save(path)``), or None for never.
        save_every: save after every this many finished requests (0 = only at shutdown).
        closers: objects with ``close()`` to call at shutdown (trace writers).
        eamc: the collection, when it is not ``engine.eamc``.
    """

    def __init__(
        self,
        engine: Any,
        eamc_path: Path | None = None,
        save_every: int = 0,
        closers: list[Any] | None = None,
        eamc: Any | None = None,
    ) -> None:
        self.engine, self.eamc_path, self.save_every = engine, eamc_path, save_every
        self.eamc = eamc if eamc is not None else getattr(engine, "eamc", None)
        self.closers = closers or []
        self._saved_at = self._finished()
        self.saves = 0

    def _finished(self) -> int:
        done = self.engine.stats.requests_finished
        return sum(n for reason, n in done.items() if reason != "abort")

    def after_step(self) -> None:
        """Engine thread, between steps: save when ``save_every`` more requests finished."""
        if not self.save_every or self.eamc is None or self.eamc_path is None:
            return
        finished = self._finished()
        if finished - self._saved_at >= self.save_every:
            self._saved_at = finished
            self.save()

    def save(self) -> None:
        if self.eamc is None or self.eamc_path is None:
            return
        self.eamc.save(self.eamc_path)
        self.saves += 1
        log.info("saved the EAMC (%s entries) to %s", self.eamc_entries(), self.eamc_path)

    def close(self) -> None:
        """At shutdown, after the engine thread stopped: final EAMC save, close trace writers."""
        try:
            self.save()
        finally:
            for obj in self.closers:
                obj.close()

    def eamc_entries(self) -> int | None:
        return None if self.eamc is None else len(self.eamc)

    def eamc_query_seconds(self) -> tuple[int, float] | None:
        stats = getattr(self.eamc, "query_stats", None)
        if stats is None:
            return None
        return int(stats.num_queries), float(stats.seconds)


def model_fingerprint(cfg: Any) -> dict[str, Any]:
    """What an EAMC file must match to be used with this model (saved with the collection)."""
    return {
        "architecture": cfg.architecture,
        "num_layers": cfg.num_moe_layers,
        "num_experts": cfg.num_experts,
    }


def build_tracing(
    cfg: Any, eamc_capacity: int, record_trace: Path | None, eamc_path: Path | None
) -> tuple[Any | None, Any | None, list[Any]]:
    """Make ``(recorder, eamc, closers)`` for the requested tracing (None, None, [] when off).

    With ``eamc_path`` the collection is loaded when the file exists (its model fingerprint must
    match), else created empty with ``eamc_capacity`` entries; the recorder commits each finished
    request's EAM to it, whatever the prefetch policy, so serving fills it online.

    Raises:
        ConfigError: the tracer package is missing, the EAMC file is unreadable or belongs to
            another model, or the trace file cannot be opened.
    """
    if record_trace is None and eamc_path is None:
        return None, None, []
    try:
        from tracer.recorder import RequestRecorder
        from tracer.trace_file import TraceWriter
    except ImportError as exc:
        raise ConfigError(f"--record-trace/--eamc-path need the tracer package ({exc})") from None
    from tracer.eamc import EAMC
    from tracer.errors import TracerError

    fingerprint = model_fingerprint(cfg)
    eamc = None
    if eamc_path is not None and eamc_path.exists():
        try:
            eamc = EAMC.load(eamc_path, fingerprint)
        except TracerError as exc:
            raise ConfigError(f"--eamc-path: {exc}") from None
    elif eamc_path is not None:
        eamc = EAMC(cfg.num_moe_layers, cfg.num_experts, capacity=eamc_capacity, fingerprint=fingerprint)
    try:
        writer = TraceWriter(record_trace) if record_trace is not None else None
    except OSError as exc:
        raise ConfigError(f"--record-trace {record_trace}: cannot open ({exc.strerror})") from None
    recorder = RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, trace_writer=writer, eamc=eamc)
    return recorder, eamc, [writer] if writer is not None else []
