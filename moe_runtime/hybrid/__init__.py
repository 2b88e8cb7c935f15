"""Hybrid expert execution: each missed expert runs where it finishes first, the CPU or the device.

``cost_model`` (pure: the simulator reuses it), ``cpu_kernels`` (the CPU kernels and their choice
at load), ``executor`` (the pool of host threads), ``placement`` (the runtime's split of a
layer's misses), ``setup`` (turning it on for an engine). docs/hybrid.md says how to use it.
"""
