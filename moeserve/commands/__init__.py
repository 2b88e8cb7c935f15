"""One module per ``moeserve`` subcommand; each exposes ``register(subparsers)``."""
