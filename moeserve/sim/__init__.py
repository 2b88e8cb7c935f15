"""Trace-driven discrete-event simulator of expert prefetching and caching at real model scales.

It replays trace files through the runtime's own buffer state machine, cache policies, prefetch
policies and I/O queue, with a cost model (:mod:`moeserve.sim.cost`) in place of copies and
kernels. See ``docs/simulator.md``.
"""
