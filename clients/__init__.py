"""HTTP clients for a running ``moeserve`` (or any OpenAI-compatible) server.

Replays Azure LLM inference trace arrivals with a multi-task prompt mix (MoE-Infinity §7.1),
records per-request latencies, and sweeps request rates (the shape of the paper's Figure 9).
This package talks HTTP only: it never imports ``moe_runtime`` or ``server``.
"""
