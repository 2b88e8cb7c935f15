"""Benchmarks that ship with the package (``moeserve bench ...``): seeded inputs, warm-up,
medians, ``--json`` output and the settings printed beside the figures."""
