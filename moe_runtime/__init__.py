"""moe_runtime: load Hugging Face MoE checkpoints and serve them with experts offloaded.

Dense layers stay on the compute device; experts live in a host expert store and stream through a
fixed buffer of device slots (MoE-Infinity, EuroSys'25, §5). See ``docs/architecture.md``.
"""

from moe_runtime.errors import CheckpointError, ConfigError, MoeServeError, RequestError

__all__ = ["CheckpointError", "ConfigError", "MoeServeError", "RequestError"]
