"""Errors the tracer raises for bad input files and data.

:class:`TracerError` is a ``ValueError`` whose message is one line naming the file and the line,
field or value at fault (``trace.jsonl:12: field 'ids': ...``). The ``moeserve`` CLI prints it as
``moeserve: error: <message>`` and exits with status 2. The tracer does not import ``moe_runtime``
(dependencies point one way: ``tracer`` <- ``moe_runtime`` <- ``server``), hence its own class.
"""

from __future__ import annotations


class TracerError(ValueError):
    """A trace file, EAMC file or routing log is missing, corrupt, misshaped or of another model."""
