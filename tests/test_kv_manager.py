"""The paged KV cache's block manager and scheduler, without tensors (vLLM v1's KVCacheManager
shape): block pool bookkeeping and LRU eviction, chained block hashes, prefix hits shared by
reference count, sliding-window groups freeing blocks and hybrid hits, admission by free blocks,
preemption by recompute to the front of the queue, and the scheduler without a manager."""

from __future__ import annotations

from collections import deque

import pytest

from moe_runtime.engine.block_pool import NULL_BLOCK, ROOT_HASH, BlockPool, hash_block
from moe_runtime.engine.kv_manager import KVCacheManager
from moe_runtime.engine.request import SamplingParams, Sequence, SequenceStatus
from moe_runtime.engine.scheduler import Scheduler
from moe_runtime.layers.kv_cache import KVLayout

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _seq(rid: str, tokens: list[int], **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params) if params else GREEDY)


def test_pool_takes_front_and_frees_to_the_back():
    pool = BlockPool(4)
    a = pool.take(2)
    assert a == [0, 1] and pool.num_free == 2 and pool.ref[:2] == [1, 1]
    pool.release(reversed(a))  # tail first: block 1 is evicted before block 0
    assert pool.take(4) == [2, 3, 1, 0]
    with pytest.raises(ValueError):
        pool.take(1)


def test_pool_evicts_cached_blocks_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.take(3)
    for b, h in zip(blocks, (b"x", b"y", b"z")):
        pool.register(b, 0, h)
    pool.release([blocks[2], blocks[0], blocks[1]])
    assert pool.lookup(0, b"x") == blocks[0] and pool.num_cached == 3
    pool.touch([blocks[0]])  # a hit takes it out of the free queue
    assert pool.num_free == 2
    assert pool.take(1) == [blocks[2]]  # the least recently freed cached block is evicted
    assert pool.lookup(0, b"z") is None and pool.evictions == 1
    assert pool.lookup(1, b"x") is None  # groups cache apart


def test_block_hash_chains_the_prefix():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4]) and len(a) == 32
    assert hash_block(a, [5, 6]) != hash_block(hash_block(ROOT_HASH, [9, 2, 3, 4]), [5, 6])


def test_allocation_and_free_return_every_block():
    kv = KVCacheManager(8, 4)
    s = _seq("a", range(10))
    assert kv.allocate(s, 10) and len(kv.tables(s)[0]) == 3 and kv.num_free == 5
    s.num_computed = 10
    assert kv.allocate(s, 1) and len(kv.tables(s)[0]) == 3  # position 10 fits block 2
    s.num_computed = 12
    assert kv.allocate(s, 1) and len(kv.tables(s)[0]) == 4
    big = _seq("b", range(20))
    assert not kv.allocate(big, 20) and not kv.holds(big)  # 5 blocks, 4 free: nothing taken
    kv.free(s)
    assert kv.num_free == 8 and kv.usage == 0.0


def test_prefix_hit_shares_full_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(16, 4)
    a = _seq("a", range(13))
    assert kv.find_cached(a) is None
    kv.allocate(a, 13)
    a.num_computed = 13
    kv.cache_computed(a)  # blocks 0..2 full (12 positions) are registered
    b = _seq("b", list(range(12)) + [99, 98])
    hit = kv.find_cached(b)
    assert hit.tokens == 12 and hit.blocks == (tuple(kv.tables(a)[0][:3]),)
    assert kv.allocate(b, 2, hit)
    assert kv.tables(b)[0][:3] == kv.tables(a)[0][:3] and kv.pool.ref[kv.tables(a)[0][0]] == 2
    c = _seq("c", range(12))  # all 12 cached, but the last token must be computed
    assert kv.find_cached(c).tokens == 8
    kv.free(a)
    kv.free(b)
    assert kv.num_free == 16 and kv.pool.num_cached == 3
    d = _seq("d", range(13))
    assert kv.find_cached(d).tokens == 12  # freed blocks stay cached until evicted
    kv.pool.take(16)  # evict everything
    assert kv.find_cached(d) is None


def test_prefix_hit_revives_free_cached_blocks_only_when_they_fit():
    kv = KVCacheManager(4, 4)
    a = _seq("a", range(9))
    kv.allocate(a, 9)
    a.num_computed = 9
    kv.cache_computed(a)
    kv.free(a)
    b = _seq("b", list(range(8)) + [7] * 12)  # hit 8 tokens (2 blocks), 12 more need 3 blocks
    hit = kv.find_cached(b)
    assert hit.tokens == 8 and not kv.allocate(b, 12, hit) and kv.num_free == 4
    assert kv.allocate(b, 8, hit) and kv.num_free == 0


def test_caching_off_registers_nothing():
    kv = KVCacheManager(8, 4, enable_caching=False)
    a = _seq("a", range(9))
    kv.allocate(a, 9)
    a.num_computed = 9
    kv.cache_computed(a)
    assert kv.pool.num_cached == 0 and kv.find_cached(_seq("b", range(9))) is None


def test_sliding_group_frees_blocks_out_of_every_window():
    """Group 0 full attention, group 1 a window of 5 positions, blocks of 2."""
    kv = KVCacheManager(32, 2, windows=(None, 5), enable_caching=False)
    s = _seq("a", range(11))
    assert kv.allocate(s, 11)
    s.num_computed = 11
    assert kv.allocate(s, 1)  # next query at 11 sees 7..11: blocks 0..2 (positions 0..5) are freed
    full, sliding = kv.tables(s)
    assert NULL_BLOCK not in full and sliding[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in sliding[3:]
    assert kv.num_free == 32 - 6 - 3
    kv.free(s)
    assert kv.num_free == 32


def test_hybrid_hit_needs_the_window_blocks_of_the_first_new_token():
    kv = KVCacheManager(64, 2, windows=(None, 3))
    a = _seq("a", range(13))
    kv.allocate(a, 13)
    a.num_computed = 13
    kv.cache_computed(a)
    assert kv.find_cached(_seq("b", range(13))).tokens == 12
    # evict the sliding block holding positions 8..9: a query at 12 sees 10..12, still cached;
    # one at 10 would see 8..10, no longer cached
    kv.free(a)
    sliding = kv.pool.lookup(1, a.kv_hashes[4])
    kv.pool.touch([sliding])
    kv.pool._cached.pop((1, a.kv_hashes[4]))
    kv.pool._key_of.pop(sliding)
    hit = kv.find_cached(_seq("c", range(13)))
    assert hit.tokens == 12 and hit.blocks[1][:5] == (NULL_BLOCK,) * 5
    hit = kv.find_cached(_seq("d", list(range(10)) + [50, 51, 52]))  # 5 full blocks shared
    assert hit.tokens == 8  # 10 would need the evicted block 4


def test_layout_groups_and_default_pool():
    lay = KVLayout.build(4, 16, 64, 4096, {0: 128, 2: 128})
    assert lay.windows == (None, 128) and lay.group_of == (1, 0, 1, 0) and lay.slot_of == (0, 0, 1, 1)
    assert lay.slots == 2 and lay.bytes_per_block(2) == 2 * 16 * 64 * 2
    assert lay.blocks_per_sequence(4096) == 256 + 9
    assert lay.min_num_blocks(4096, 4096) == 256 + 256
    assert lay.default_num_blocks(8, 4096, 4096) == 8 * 265
    assert KVLayout.build(3, 16, 8, 64, {0: 64}).windows == (None,)  # a window of max_len is full


# ---------------------------------------------------------------------------- scheduler


def test_scheduler_admits_by_free_blocks_fcfs():
    kv = KVCacheManager(6, 4, enable_caching=False)
    sched = Scheduler(8, 100, kv)
    seqs = [_seq(str(i), range(n)) for i, n in enumerate([9, 13, 3])]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    # "1" needs 4 blocks, 3 are free: it waits, and "2" (1 block) does not overtake it
    assert [o.seq.request_id for o in out] == ["0"] and kv.num_free == 3
    assert list(sched.waiting) == seqs[1:]


def test_scheduler_preempts_the_latest_and_resumes_with_outputs_kept():
    kv = KVCacheManager(4, 2, enable_caching=False)
    sched = Scheduler(4, 100, kv)
    a, b = _seq("a", range(3)), _seq("b", range(3))
    sched.add(a)
    sched.add(b)
    assert [o.num_new for o in sched.schedule()] == [3, 3]  # 2 blocks each: pool full
    for s in (a, b):
        s.num_computed = 3
        s.output_token_ids.append(7)
    out = sched.schedule()  # a's 4th position fits its block 1; b's too
    assert [o.seq.request_id for o in out] == ["a", "b"]
    for s in (a, b):
        s.num_computed = 4
        s.output_token_ids.append(8)
    out = sched.schedule()  # a needs a 3rd block: b (the latest) is preempted
    assert [o.seq.request_id for o in out] == ["a"] and sched.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.num_computed == 0 and b.output_token_ids == [7, 8]
    assert list(sched.waiting) == [b] and b.num_preemptions == 1
    sched.finish(a)
    out = sched.schedule()  # b re-prefills prompt + generated tokens and samples at the end
    assert out[0].seq is b and out[0].num_new == 5 and out[0].sample


def test_scheduler_self_preemption_when_alone_at_the_end():
    kv = KVCacheManager(3, 2, enable_caching=False)
    sched = Scheduler(4, 100, kv)
    a, b = _seq("a", range(4)), _seq("b", range(2))
    sched.add(a)
    sched.add(b)
    sched.schedule()  # a: 2 blocks, b: 1 block
    a.num_computed, b.num_computed = 4, 2
    b.output_token_ids.append(1)
    a.output_token_ids.append(1)
    out = sched.schedule()  # a needs a 3rd block: b preempted; then b is gone
    assert [o.seq.request_id for o in out] == ["a"] and list(sched.waiting) == [b]


def test_scheduler_counts_prefix_lookups_of_admitted_sequences():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(4, 100, kv)
    a = _seq("a", range(9))
    sched.add(a)
    sched.schedule()
    a.num_computed = 9
    sched.computed(a)
    b = _seq("b", range(9))
    c = _seq("c", range(9), prompt_logprobs=1, max_tokens=8, temperature=0)  # skips the cache
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert [(o.seq.request_id, o.num_new, o.hit is not None) for o in out][1:] == [
        ("b", 1, True),
        ("c", 9, False),
    ]
    assert b.num_cached_tokens == 8 and b.num_computed == 8 and c.num_cached_tokens == 0
    assert (kv.queries, kv.hits) == (18, 8)


def test_scheduler_without_manager_is_batch_bounded():
    """The simulator's use: no blocks, sequences computed past their prompt decode one token."""
    sched = Scheduler(2, 10, None)
    seqs = [_seq(str(i), [0] * 6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [(o.seq.request_id, o.num_new, o.sample) for o in out] == [("0", 6, True), ("1", 4, False)]
    seqs[0].num_computed, seqs[1].num_computed = 6, 4
    out = sched.schedule()
    assert [(o.num_new, o.sample) for o in out] == [(1, True), (2, True)]
    assert sched.waiting == deque([seqs[2]])
