"""Errors the clients raise for bad input (trace files, prompt files, flags)."""

from __future__ import annotations


class ClientError(ValueError):
    """A user-caused client error: one line naming the file and row (or flag) at fault.

    ``moeserve``'s CLI prints it as ``moeserve: error: <message>`` and exits with status 2.
    """
