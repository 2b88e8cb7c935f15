"""Expert buffer: fixed device slots, residency map, cache policies, placement over devices."""

from moe_runtime.buffer.expert_buffer import ExpertBuffer
from moe_runtime.buffer.layer_run import ExpertHandle

__all__ = ["ExpertBuffer", "ExpertHandle"]
