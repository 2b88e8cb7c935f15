"""Starting ``moeserve serve`` in a subprocess from a test: a free port, and waiting until its
``/health`` answers (failing with the server's stderr if it exits first)."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A loopback port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    """Poll ``base``/health until it answers 200; fail if ``proc`` exits or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
