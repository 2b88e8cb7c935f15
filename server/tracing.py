"""Tracer plumbing for the server: build the recorder, save the EAMC, expose EAMC figures.

The EAMC (MoE-Infinity §4.2) fills online: the tracer's recorder commits each finished request's
EAM to it on the engine thread. The server saves it every ``--eamc-save-every`` finished requests
(from the engine thread, between steps, so no step mutates it meanwhile) and once more at
shutdown after the engine thread stopped.

A failed save is never fatal while serving, but always visible: the first failure (and the
recovery) is logged once, ``moeserve_eamc_save_failures_total`` counts them, and a failed final
save makes ``moeserve serve`` exit with status 1. At start the path is checked up front
(:func:`check_eamc_path`): a directory, a missing or unwritable folder is a one-line error.
"""

from __future__ import annotations

import logging
import os
import tempfile
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
        self.save_failures = 0
        self.last_save_error: str | None = None  # None once a save succeeded again
        self.final_save_failed = False

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

    def save(self) -> bool:
        """Write the EAMC to ``eamc_path``; True on success (or nothing to save).

        A failure (``OSError``, e.g. disk full or the folder removed) is counted and logged once
        until a save succeeds again; it never raises.
        """
        if self.eamc is None or self.eamc_path is None:
            return True
        try:
            self.eamc.save(self.eamc_path)
        except (OSError, ValueError) as exc:
            self.save_failures += 1
            message = f"{self.eamc_path}: cannot save the EAMC ({type(exc).__name__}: {exc})"
            if self.last_save_error is None:
                log.error("%s; the collection stays in memory, later saves will retry", message)
            self.last_save_error = message
            return False
        self.saves += 1
        if self.last_save_error is not None:
            failed = self.save_failures
            log.warning("saved the EAMC to %s again after %d failed save(s)", self.eamc_path, failed)
            self.last_save_error = None
        log.info("saved the EAMC (%s entries) to %s", self.eamc_entries(), self.eamc_path)
        return True

    def close(self) -> None:
        """At shutdown, after the engine thread stopped: final EAMC save, close trace writers.

        A failed final save sets ``final_save_failed`` (``moeserve serve`` then exits 1).
        """
        try:
            if not self.save():
                self.final_save_failed = True
                log.error("the final EAMC save failed: %s", self.last_save_error)
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

    def eamc_saves(self) -> tuple[int, int] | None:
        """``(saves, failed saves)``, or None when no EAMC is saved."""
        if self.eamc is None or self.eamc_path is None:
            return None
        return self.saves, self.save_failures


def check_eamc_path(path: Path) -> None:
    """Check at start that ``path`` can hold the EAMC file; remove stale temp files beside it.

    Temp files (``.<name>.*.tmp``) are what an atomic save leaves when the process is killed
    mid-write; nothing else writes them, so they are removed.

    Raises:
        ConfigError: ``path`` is a directory, its folder is missing or not a folder, the file is
            not writable, or a test file cannot be created there (one line naming the path and
            the reason).
    """
    from tracer.atomic import remove_stale_temps

    if path.is_dir():
        raise ConfigError(f"--eamc-path {path}: is a directory; give a file path such as {path / 'eamc.npz'}")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"--eamc-path {path}: {folder} {what}")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
        removed = remove_stale_temps(path)
    except OSError as exc:
        raise ConfigError(f"--eamc-path {path}: cannot write in {folder} ({exc.strerror or exc})") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"--eamc-path {path}: the file is not writable")
    if removed:
        log.warning("removed %d stale EAMC temp file(s) beside %s (interrupted saves)", len(removed), path)


def model_fingerprint(cfg: Any) -> dict[str, Any]:
    """What an EAMC file must match to be used with this model (saved with the collection)."""
    return {
        "architecture": cfg.architecture,
        "num_layers": cfg.num_moe_layers,
        "num_experts": cfg.num_experts,
    }


def build_tracing(
    cfg: Any,
    eamc_capacity: int,
    record_trace: Path | None,
    eamc_path: Path | None,
    on_corrupt: str = "fail",
) -> tuple[Any | None, Any | None, list[Any]]:
    """Make ``(recorder, eamc, closers)`` for the requested tracing (None, None, [] when off).

    With ``eamc_path`` the collection is loaded when the file exists (its model fingerprint must
    match), else created empty with ``eamc_capacity`` entries; the recorder commits each finished
    request's EAM to it, whatever the prefetch policy, so serving fills it online. A corrupt
    file is an error with ``on_corrupt="fail"``; with ``"reset"`` it is logged and the collection
    starts empty (the next save replaces the file). An EAMC of another model is always an error.

    Raises:
        ConfigError: the tracer package is missing, the EAMC file is corrupt
            (``on_corrupt="fail"``), unreadable or belongs to another model, or the trace file
            cannot be opened. Check the path first with :func:`check_eamc_path`.
    """
    if on_corrupt not in ("fail", "reset"):
        raise ConfigError(f"--eamc-on-corrupt must be 'fail' or 'reset', got {on_corrupt!r}")
    if record_trace is None and eamc_path is None:
        return None, None, []
    try:
        from tracer.recorder import RequestRecorder
        from tracer.trace_file import TraceWriter
    except ImportError as exc:
        raise ConfigError(f"--record-trace/--eamc-path need the tracer package ({exc})") from None
    from tracer.eamc import EAMC
    from tracer.eamc_store import CorruptEAMCError, check_eamc_size
    from tracer.errors import TracerError

    fingerprint = model_fingerprint(cfg)
    eamc = None
    if eamc_path is not None:
        if eamc_path.exists():
            try:
                eamc = EAMC.load(eamc_path, fingerprint)
            except CorruptEAMCError as exc:
                if on_corrupt == "fail":
                    raise ConfigError(f"--eamc-path: {exc} (--eamc-on-corrupt reset starts empty)") from None
                log.error("--eamc-path: %s; starting with an empty EAMC (--eamc-on-corrupt reset)", exc)
            except TracerError as exc:
                raise ConfigError(f"--eamc-path: {exc}") from None
        if eamc is None:
            try:
                check_eamc_size(eamc_capacity, cfg.num_moe_layers, cfg.num_experts, "--eamc-capacity")
            except TracerError as exc:
                raise ConfigError(str(exc)) from None
            eamc = EAMC(cfg.num_moe_layers, cfg.num_experts, capacity=eamc_capacity, fingerprint=fingerprint)
    try:
        writer = TraceWriter(record_trace) if record_trace is not None else None
    except OSError as exc:
        raise ConfigError(f"--record-trace {record_trace}: cannot open ({exc.strerror})") from None
    recorder = RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, trace_writer=writer, eamc=eamc)
    return recorder, eamc, [writer] if writer is not None else []
