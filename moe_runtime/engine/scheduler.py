"""FCFS continuous-batching scheduler: who runs in the next step, and how many tokens each.

The scheduler never touches tensors (vLLM v1's boundary). Each step it keeps every running
sequence (one decode token, or the next chunk of its prompt) and then admits waiting sequences in
arrival order while a batch slot, a KV-cache row and token budget remain. A prompt larger than the
step's token budget is prefilled in chunks over several steps. Prefill therefore shares steps with
decodes: one forward pass, one expert fetch per needed expert for both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moe_runtime.engine.request import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed this step
    sample: bool  # the step's last token of this sequence is sampled


class Scheduler:
    """Args: max_batch_size: sequences per step (= KV-cache rows); max_num_batched_tokens: token
    budget per step."""

    def __init__(self, max_batch_size: int, max_num_batched_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_rows = list(range(max_batch_size - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        for seq in self.running:
            if budget == 0:
                break
            n = self._chunk(seq, budget)
            budget -= n
            out.append(ScheduledSeq(seq, n, seq.num_computed + n >= len(seq.prompt_token_ids)))
        while self.waiting and self._free_rows and budget > 0:
            seq = self.waiting.popleft()
            seq.kv_row = self._free_rows.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget)
            budget -= n
            out.append(ScheduledSeq(seq, n, n >= len(seq.prompt_token_ids)))
        return out

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        remaining = len(seq.prompt_token_ids) - seq.num_computed
        return min(remaining, budget) if remaining > 0 else 1

    def take_row(self) -> int | None:
        """Borrow a free KV row outside of scheduling (teacher-forced scoring); None if none."""
        return self._free_rows.pop() if self._free_rows else None

    def return_row(self, row: int) -> None:
        self._free_rows.append(row)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and recycle its KV row."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._free_rows.append(seq.kv_row)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
