"""The ``moeserve`` command line: one entry point, one module per subcommand."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("moeserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
