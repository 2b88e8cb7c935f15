"""Expert buffer: fixed device slots, residency map, cache policies, placement over devices."""

from moe_runtime.buffer.expert_buffer import ExpertBuffer, ExpertHandle

__all__ = ["ExpertBuffer", "ExpertHandle"]
