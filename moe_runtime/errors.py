"""Errors the runtime raises for bad input.

Every error a user can cause (a bad checkpoint, a bad flag, a prompt that is too long) is a
:class:`MoeServeError`. Its message is one line naming the file, tensor, field or value at fault;
the CLI prints it as ``moeserve: error: <message>`` and exits with status 2, and the server maps it
to an OpenAI error object with status 400.
"""

from __future__ import annotations


class MoeServeError(ValueError):
    """Base class of user-caused errors: one line, names what is wrong."""


class CheckpointError(MoeServeError):
    """A checkpoint folder, file or tensor is missing, corrupt or misshaped."""


class ConfigError(MoeServeError):
    """A configuration value (``config.json`` field or runtime setting) is unsupported or invalid."""


class RequestError(MoeServeError):
    """A request cannot be served as asked (e.g. the prompt is longer than the context).

    Attributes:
        param: the request field at fault, as the OpenAI error object names it (``"prompt"``,
            ``"max_tokens"``, ...), or None when no single field is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InsufficientMemoryError(MoeServeError):
    """The planned host or device memory of a model does not fit in what is available."""
