"""OpenAI-compatible HTTP service over the offloading runtime (see ``docs/server.md``).

Build an app with :func:`server.app.create_app`; ``moeserve serve`` runs it under uvicorn.
"""

from server.app import create_app
from server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
