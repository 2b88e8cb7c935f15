"""Per-step metadata that travels beside the packed token tensor (nano-vllm's context object).

Tokens of all scheduled sequences are packed into one ``[T]`` tensor; sequence ``i`` owns tokens
``starts[i] : starts[i] + num_new[i]`` at positions ``ctx_lens[i] - num_new[i] ..``. Its KV
positions live in the paged KV cache (``moe_runtime.layers.kv_cache``): per block group ``g``,
position ``p`` is at block ``tables[g][i, p // block_size]``, offset ``p % block_size``; the step's
new tokens are written at the flat slots ``slots[g]`` (``block * block_size + offset``). Block tables
and slots reach the device in one copy per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moe_runtime.jit import njit
from moe_runtime.layers.kv_cache import cdiv


@dataclass(slots=True)
class StepContext:
    request_ids: list[str]
    starts: list[int]
    num_new: list[int]
    ctx_lens: list[int]
    positions: torch.Tensor  # [T] int64
    token_seq: np.ndarray  # [T] int64, sequence index of each token
    token_prefill: np.ndarray  # [T] bool, prompt token
    logits_index: torch.Tensor  # [N] token indices whose logits are sampled
    all_decode: bool
    max_ctx: int
    block_size: int = 16
    # per block group: the sequences' block tables [S, W] (W = blocks of the longest context;
    # freed or unused entries 0) on the device and on the host, and each new token's flat slot [T]
    tables: list[torch.Tensor] = field(default_factory=list)
    tables_host: list[np.ndarray] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    observe: bool = True  # tracing and policies see this step's routing (False when scoring)
    # ``logits_index`` as built was every token in order (a decode step): while it still has T
    # entries (scoring appends rows) the model skips the row gather
    logits_all: bool = False
    # sequences with one new token (decodes), attended in one batched call: their index among the
    # step's sequences (None when every sequence decodes), their tokens' indices in the packed step
    # (None when every sequence decodes: all tokens, in order), the length mask over their longest
    # context, and the indices of the other sequences
    decode_seq_t: torch.Tensor | None = None  # [B_d] int64
    decode_tokens: torch.Tensor | None = None  # [B_d] int64
    decode_mask: torch.Tensor | None = None  # [B_d, 1, 1, decode_ctx] bool
    decode_ctx: int = 0
    decode_full: bool = False  # every decoding sequence's context is decode_ctx long: no mask needed
    decode_seqs: list[int] = field(default_factory=list)  # their indices, on the host
    prefill_seqs: list[int] = field(default_factory=list)
    positions_host: np.ndarray | None = None  # ``positions`` on the host [T] int64
    # two or more prefill chunks attended in one padded call (when padding costs at most
    # PAD_WASTE x the useful work): their index among the step's sequences, their tokens' indices
    # in the packed step, each token's index in the padded [P * max_new] queries, and the causal
    # mask over their contexts
    prefill_seq_t: torch.Tensor | None = None  # [P] int64
    prefill_tokens: torch.Tensor | None = None  # [sum n_p] int64
    prefill_pad: torch.Tensor | None = None  # [sum n_p] int64
    prefill_mask: torch.Tensor | None = None  # [P, 1, max_new, prefill_ctx] bool
    # per MoE layer run in this step: (router ids [T, k], hit [E] bool, blocked seconds [E]), kept
    # by reference and reduced once per step into per-sequence figures (expert_attribution)
    moe_layers: list = field(default_factory=list)
    # per device-routed MoE layer (moe_runtime.layers.resident_experts): (MoE layer, ids [T, k],
    # weights [T, k]) on the device; the host's per-layer work runs at the forward's end
    device_routed: list = field(default_factory=list)
    # what the layers share within the step, built by the first layer that needs it: gathered
    # block tables, masks per sliding window, float masks per dtype (``moe_runtime.layers.attention``)
    memo: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    def expert_attribution(self, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per sequence ``[S]``: expert lookups, buffer hits (int64) and blocked seconds (float64)
        of the step's MoE layers (:attr:`moe_layers`). Each sequence is charged, per layer, the
        distinct experts its own tokens chose, and each such expert's hit and blocking (an expert
        several sequences chose is charged to each of them).

        One compiled pass over every layer at the step's end (:func:`_attribute`): the per-layer
        form (a ``[S, E]`` table and three reductions per MoE layer, or three small reductions for
        one sequence) cost the compute thread 26-74 us per layer on the bundled model (thread CPU
        time, batch 1 and 4, caches cold after the expert GEMMs), and one numpy reduction over a
        ``[L, S, E]`` table about 190 us per step at batch 4. Blocked seconds are summed in
        another order than per layer (equal up to float rounding)."""
        S = self.num_seqs
        layers = self.moe_layers
        if not layers:
            return np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.float64)
        # concatenated, not stacked (np.stack is two numpy calls per layer), then one compiled pass
        ids = np.concatenate([x[0] for x in layers]).astype(np.int64, copy=False)  # [L * T, k]
        hit = np.concatenate([x[1] for x in layers]).astype(np.bool_, copy=False)  # [L * E]
        blocked = np.concatenate([x[2] for x in layers]).astype(np.float64, copy=False)  # [L * E]
        seq = self.token_seq.astype(np.int64, copy=False)
        return _attribute(ids, hit, blocked, seq, S, num_experts)

    def cpu_attribution(self, num_experts: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Per sequence ``[S]``: experts computed on the CPU (int64) and their CPU seconds (float64)
        in the step's MoE layers that placed some there (hybrid execution, ``moe_runtime.hybrid``:
        such a layer's :attr:`moe_layers` entry also holds ``(on_cpu [E] bool, seconds [E])``);
        None when none did. Charged as :meth:`expert_attribution` charges hits and blocking: per
        layer, each sequence the distinct CPU experts its tokens chose (the same compiled pass)."""
        layers = [x for x in self.moe_layers if len(x) > 3]
        if not layers:
            return None
        ids = np.concatenate([x[0] for x in layers]).astype(np.int64, copy=False)
        on_cpu = np.concatenate([x[3] for x in layers]).astype(np.bool_, copy=False)
        seconds = np.concatenate([x[4] for x in layers]).astype(np.float64, copy=False)
        seq = self.token_seq.astype(np.int64, copy=False)
        _, n, secs = _attribute(ids, on_cpu, seconds, seq, self.num_seqs, num_experts)
        return n, secs

    def cached(self, key, build, *args):
        """``build(*args)`` the first time ``key`` is asked for in this step, the same object after
        (the step's masks, built once and shared by every layer)."""
        if key not in self.memo:
            self.memo[key] = build(*args)
        return self.memo[key]

    @classmethod
    def build(
        cls,
        request_ids: list[str],
        tables: list[list[list[int]]],
        past: list[int],
        num_new: list[int],
        sample: list[bool],
        device: torch.device,
        block_size: int,
        all_logits: bool = False,
        prompt_lens: list[int] | None = None,
    ) -> StepContext:
        """Build the context for sequences with ``past[i]`` cached tokens and ``num_new[i]`` new ones.

        Args:
            tables: per sequence, its block table per block group (block ids; negative entries,
                blocks a sliding group freed, are never read); each covers ``past + num_new``
                positions.
            sample: whether sequence ``i`` samples a token this step (its last new token's logits
                are computed); a prefill chunk that does not reach the end of its tokens does not.
            block_size: token positions per KV block.
            all_logits: compute logits at every token instead (teacher-forced scoring).
            prompt_lens: each sequence's prompt length: a token is a prompt token when its position
                is below it (a recompute after preemption re-prefills generated tokens too);
                without it, the tokens of a sequence with several new tokens or no past are.
        """
        starts, acc = [], 0
        for n in num_new:
            starts.append(acc)
            acc += n
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(past, num_new)])
        token_seq = np.repeat(np.arange(len(request_ids)), num_new)
        if prompt_lens is not None:
            token_prefill = positions < np.asarray(prompt_lens, dtype=np.int64)[token_seq]
        else:
            token_prefill = np.array([n > 1 or p == 0 for p, n in zip(past, num_new)])[token_seq]
        ctx = [p + n for p, n in zip(past, num_new)]
        logits_index = [s + n - 1 for s, n, smp in zip(starts, num_new, sample) if smp]
        if all_logits:
            logits_index = list(range(acc))
        all_decode = all(n == 1 for n in num_new)
        max_ctx = max(ctx)
        # block tables [G, S, W] and each new token's slot [G, T]: one host array, one copy. At
        # least two columns (a spare one of zeros): a compiled decode step (engine.compiled_decode)
        # would otherwise meet a one-block table as a shape of its own and compile again
        groups, seqs, width = len(tables[0]), len(request_ids), max(cdiv(max_ctx, block_size), 2)
        tab = np.zeros((groups, seqs, width), dtype=np.int64)
        for i, per_group in enumerate(tables):
            for g, row in enumerate(per_group):
                n = min(len(row), width)
                tab[g, i, :n] = row[:n]
        np.maximum(tab, 0, out=tab)
        slots = tab[:, token_seq, positions // block_size] * block_size + positions % block_size
        dec = [i for i, n in enumerate(num_new) if n == 1]
        dec_ctx = np.asarray([ctx[i] for i in dec], dtype=np.int64)
        host = np.concatenate(
            [positions, slots.reshape(-1), tab.reshape(-1), dec, [starts[i] for i in dec], dec_ctx]
        ).astype(np.int64)
        dev = torch.from_numpy(host).to(device)
        t, ns = len(positions), groups * seqs * width
        slots_t = dev[t : t + groups * t].view(groups, t)
        tab_t = dev[t + groups * t : t + groups * t + ns].view(groups, seqs, width)
        rest = dev[t + groups * t + ns :].view(3, len(dec))
        ctx_obj = cls(
            request_ids=request_ids,
            starts=starts,
            num_new=num_new,
            ctx_lens=ctx,
            positions=dev[:t],
            token_seq=token_seq,
            token_prefill=token_prefill,
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=device),
            all_decode=all_decode,
            max_ctx=max_ctx,
            block_size=block_size,
            tables=list(tab_t),
            tables_host=list(tab),
            slots=list(slots_t),
            logits_all=len(logits_index) == acc,
        )
        ctx_obj.prefill_seqs = [i for i, n in enumerate(num_new) if n != 1]
        ctx_obj.decode_seqs = dec
        ctx_obj.positions_host = positions
        if dec:
            ctx_obj.decode_ctx = int(dec_ctx.max())
            ctx_obj.decode_full = bool(dec_ctx.min() == ctx_obj.decode_ctx)
            ctx_obj.decode_seq_t = None if all_decode else rest[0]
            ctx_obj.decode_tokens = None if all_decode else rest[1]
            mask = torch.arange(ctx_obj.decode_ctx, device=device)[None, :] < rest[2][:, None]
            ctx_obj.decode_mask = mask[:, None, None, :]
        if len(ctx_obj.prefill_seqs) > 1:
            _padded_prefill(ctx_obj, device)
        return ctx_obj


PAD_WASTE = 2.0  # padded prefill attention when its score matrix is at most this x the useful one


def _padded_prefill(step: StepContext, device: torch.device) -> None:
    """Set ``step.prefill_*`` for one padded SDPA over the step's prefill chunks, unless padding
    would cost more than :data:`PAD_WASTE` times the per-chunk calls' work (then they stay
    separate calls)."""
    seqs = step.prefill_seqs
    new = np.asarray([step.num_new[i] for i in seqs], dtype=np.int64)
    ctx = np.asarray([step.ctx_lens[i] for i in seqs], dtype=np.int64)
    max_new, max_ctx = int(new.max()), int(ctx.max())
    if len(seqs) * max_new * max_ctx > PAD_WASTE * int((new * ctx).sum()):
        return
    seq_of = np.repeat(np.arange(len(seqs)), new)  # per prefill token: its chunk
    within = np.arange(int(new.sum())) - np.repeat(np.cumsum(new) - new, new)  # index in the chunk
    tokens = np.asarray([step.starts[i] for i in seqs], dtype=np.int64)[seq_of] + within
    # query i of chunk p sits at position past_p + i and sees keys 0 .. past_p + i; padded queries
    # (i >= n_p) see key 0 only, so no row is fully masked (their output is dropped)
    last = np.where(np.arange(max_new)[None, :] < new[:, None], (ctx - new)[:, None] + np.arange(max_new), 0)
    host = np.concatenate([seqs, tokens, seq_of * max_new + within, last.reshape(-1)])
    dev = torch.from_numpy(host.astype(np.int64)).to(device)  # one copy
    p, n = len(seqs), len(tokens)
    step.prefill_seq_t = dev[:p]
    step.prefill_tokens = dev[p : p + n]
    step.prefill_pad = dev[p + n : p + 2 * n]
    last_t = dev[p + 2 * n :].view(p, max_new)
    step.prefill_mask = (torch.arange(max_ctx, device=device)[None, None, :] <= last_t[:, :, None])[:, None]


@njit(cache=True)
def _attribute(
    ids: np.ndarray,
    hit: np.ndarray,
    blocked: np.ndarray,
    token_seq: np.ndarray,
    num_seqs: int,
    num_experts: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`StepContext.expert_attribution` of ``L`` MoE layers: ``ids [L * T, k]`` (int64,
    layer ``l``'s ``[T, k]`` at rows ``l * T ..``), ``hit [L * E]`` (bool) and ``blocked [L * E]``
    (float64, seconds) per layer and expert, ``token_seq [T]`` (int64) each token's sequence.
    Returns ``(lookups, hits, blocking)``, ``[S]`` each: per layer, each sequence's distinct
    experts (a ``[S, E]`` mark, cleared after each layer), their hits and blocked seconds."""
    T = token_seq.size
    L = ids.shape[0] // T if T else 0
    k = ids.shape[1]
    lookups = np.zeros(num_seqs, dtype=np.int64)
    hits = np.zeros(num_seqs, dtype=np.int64)
    blocking = np.zeros(num_seqs, dtype=np.float64)
    mark = np.zeros((num_seqs, num_experts), dtype=np.bool_)
    for layer in range(L):
        row0, key0 = layer * T, layer * num_experts
        for t in range(T):
            s = token_seq[t]
            for j in range(k):
                e = ids[row0 + t, j]
                if not mark[s, e]:
                    mark[s, e] = True
                    lookups[s] += 1
                    if hit[key0 + e]:
                        hits[s] += 1
                    blocking[s] += blocked[key0 + e]
        for t in range(T):
            s = token_seq[t]
            for j in range(k):
                mark[s, ids[row0 + t, j]] = False
    return lookups, hits, blocking


def warm() -> None:
    """Compile (or load from numba's on-disk cache) :func:`_attribute` for the types a step
    passes, so the first step does not pay the compile."""
    one = np.zeros((1, 1), dtype=np.int64)
    _attribute(one, np.zeros(1, dtype=np.bool_), np.zeros(1), np.zeros(1, dtype=np.int64), 1, 1)
