"""FCFS continuous-batching scheduler: who runs in the next step, and how many tokens each.

The scheduler never touches tensors (vLLM v1's boundary). Each step it keeps every running
sequence (one decode token, or the next chunk of its prompt) and then admits waiting sequences in
arrival order while a batch slot, token budget and KV-cache blocks remain. A prompt larger than the
step's token budget is prefilled in chunks over several steps. Prefill therefore shares steps with
decodes: one forward pass, one expert fetch per needed expert for both.

KV blocks (:class:`~moe_runtime.engine.kv_manager.KVCacheManager`): a running sequence gets the
blocks its step's tokens need; a waiting one is admitted only when its first chunk's blocks are
free, after a prefix-cache hit supplied what it could. When a running sequence finds no free block,
the most recently admitted running sequence is preempted by recompute (vLLM v1's policy): its
blocks are freed, its computed count drops to 0 and it goes back to the front of the waiting queue
with its generated tokens kept; readmitted, it prefills prompt + generated tokens again (its own
blocks may still be cached) and samples its next token from the last of them, so it finishes with
the tokens it would have produced, later. No waiting sequence is admitted in a step that preempted.

Without a block manager (the simulator) admission is bounded by the batch size alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moe_runtime.engine.kv_manager import CacheHit, KVCacheManager
from moe_runtime.engine.request import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's part of a step.

    Attributes:
        num_new: positions computed this step, from ``seq.num_computed``.
        sample: the step's last token of this sequence is sampled (its chunk reaches the end of
            its tokens).
        hit: the prefix-cache hit this step's admission took (its blocks' positions are not
            computed), or None.
    """

    seq: Sequence
    num_new: int
    sample: bool
    hit: CacheHit | None = None


class Scheduler:
    """Args: max_batch_size: sequences per step; max_num_batched_tokens: token budget per step;
    kv: the KV-cache block manager (None: no block accounting, as the simulator runs it)."""

    def __init__(
        self, max_batch_size: int, max_num_batched_tokens: int, kv: KVCacheManager | None = None
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            while self.kv is not None and not self.kv.allocate(seq, n):
                victim = self.running.pop()  # the latest admitted; never one already scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                budget -= n
                out.append(ScheduledSeq(seq, n, seq.num_computed + n >= seq.num_tokens))
                i += 1
                continue
            break  # it preempted itself: it was the last running sequence
        while not preempted and self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            hit = self._lookup(seq)
            start = hit.tokens if hit is not None else 0
            n = min(seq.num_tokens - start, budget) if seq.num_tokens > start else 1
            if self.kv is not None:
                if not self.kv.allocate(seq, n, hit):
                    break  # FCFS: nobody overtakes the head of the queue
                if self.kv.enable_caching and self._cacheable(seq):
                    self.kv.record_lookup(seq, hit)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed = start
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = start
            self.running.append(seq)
            budget -= n
            out.append(ScheduledSeq(seq, n, start + n >= seq.num_tokens, hit))
        return out

    def _lookup(self, seq: Sequence) -> CacheHit | None:
        if self.kv is None or not self._cacheable(seq):
            return None
        return self.kv.find_cached(seq)

    @staticmethod
    def _cacheable(seq: Sequence) -> bool:
        """Prompt logprobs need every prompt position computed (vLLM skips the cache for them)."""
        return seq.params.prompt_logprobs is None

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free its blocks, to the front of the waiting queue."""
        if self.kv is not None:
            self.kv.free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed
        return min(remaining, budget) if remaining > 0 else 1

    def computed(self, seq: Sequence) -> None:
        """``seq``'s step is done (``num_computed`` updated): its full blocks join the prefix cache."""
        if self.kv is not None:
            self.kv.cache_computed(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its KV blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            if self.kv is not None:
                self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
