"""vLLM-style prefix-cache tests on a tiny pool (11 blocks of 16 tokens): exact block ids, hit counts
and eviction order for the deterministic prefix set (0, 1, several blocks, full±1)."""

import pytest

from kvpage.cache import BlockState
from kvpage.errors import OutOfBlocks

S = BlockState


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


A50 = toks(1000, 50)


def test_shared_prefix_of_zero_blocks(h):
    a = h.prefill(1, toks(1000, 40))
    b = h.prefill(2, toks(5000, 40))
    assert (a.cached, a.table.block_ids) == (0, [0, 1, 2])
    assert (b.cached, b.table.block_ids) == (0, [3, 4, 5])
    assert (h.m.stats.queries_tokens, h.m.stats.hit_tokens) == (80, 0)
    assert len(h.m.index) == 4  # two full blocks each; partial blocks are never published


def test_shared_prefix_of_one_full_block(h):
    h.prefill(1, toks(1000, 40))
    b = h.prefill(2, toks(1000, 16) + toks(5000, 24))
    assert (b.cached, b.table.block_ids) == (16, [0, 3, 4])
    blk = h.m.pool.blocks[0]
    assert (blk.ref_count, blk.state, blk.owners) == (2, S.SHARED_READONLY, {1, 2})
    entry = h.m.index.by_block[0]  # what the hit was served from
    assert (entry.digest, entry.namespace) == (b.chain.keys[0].digest, h.ns.digest())
    assert blk.valid_len == 16  # a hit on a full block only


def test_shared_prefix_of_several_full_blocks(h):
    h.prefill(1, A50)
    b = h.prefill(2, A50[:48] + toks(5000, 10))
    assert (b.cached, b.table.block_ids) == (48, [0, 1, 2, 4])
    assert [h.m.pool.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]


def test_shared_prefix_of_full_plus_one(h):
    h.prefill(1, A50)
    b = h.prefill(2, A50[:17] + toks(5000, 23))
    # The 17th shared token sits in a partial block: only the full block is reused.
    assert (b.cached, b.table.block_ids) == (16, [0, 4, 5])


def test_shared_prefix_of_full_minus_one(h):
    h.prefill(1, A50)
    b = h.prefill(2, A50[:15] + toks(5000, 25))
    assert (b.cached, b.table.block_ids) == (0, [4, 5, 6])
    assert h.m.stats.hit_tokens == 0


def test_fully_cached_prompt_leaves_last_token_to_compute(h):
    a = h.prefill(1, A50[:48])
    assert a.table.block_ids == [0, 1, 2] and a.table.num_published == 3
    b = h.prefill(2, A50[:48])
    # Capped at k-1 blocks: block 2 is recomputed privately so the last token yields logits.
    assert (b.cached, b.table.block_ids) == (32, [0, 1, 3])
    assert h.m.max_hit_blocks(48) == 2 < 48 // 16  # capped
    assert h.m.pool.blocks[3].state is S.PRIVATE_WRITABLE  # key 2 stays with block 2
    assert b.table.publish_blocked
    c = h.prefill(3, A50[:49])
    assert (c.cached, c.table.block_ids) == (48, [0, 1, 2, 4])
    assert h.m.max_hit_blocks(49) == 3  # not capped


def test_short_prompts_never_hit(h):
    h.prefill(1, A50[:48])
    assert h.prefill(2, A50[:16]).cached == 0  # exactly one block: must be computed
    assert h.prefill(3, A50[:10]).cached == 0


def test_eviction_is_leaf_first_then_lru_with_exact_ids(h):
    a = h.prefill(1, toks(1000, 48))
    h.m.free_table(a.table)  # 2, 1, 0 become CACHED, tail first
    b = h.prefill(2, toks(2000, 33))
    assert b.table.block_ids == [3, 4, 5]
    h.m.free_table(b.table)  # 5 partial -> FREE; 4, 3 -> CACHED
    u = h.m.usage()
    assert (u.free, u.cached) == (6, 5)
    assert list(h.m.pool.free_ids) == [6, 7, 8, 9, 10, 5]
    assert h.m.index.evictable_leaves() == [2, 4]  # parents 1, 0, 3 wait for their children
    gen_before = [blk.generation for blk in h.m.pool.blocks]
    c = h.prefill(3, toks(3000, 128))
    assert c.table.block_ids == [6, 7, 8, 9, 10, 5, 2, 1]
    assert h.m.stats.evictions == 2
    assert h.m.pool.blocks[2].generation == gen_before[2] + 1
    assert h.m.pool.blocks[1].generation == gen_before[1] + 1
    a2 = h.prefill(4, toks(1000, 48))
    assert (a2.cached, a2.table.block_ids) == (16, [0, 4, 3])  # B's chain evicted leaf first
    assert h.m.stats.evictions == 4


def test_eviction_order_follows_last_use(h):
    a = h.prefill(1, toks(1000, 32))
    h.m.free_table(a.table)
    b = h.prefill(2, toks(2000, 32))
    h.m.free_table(b.table)
    a2 = h.prefill(3, toks(1000, 33))  # touches A's blocks again
    assert (a2.cached, a2.table.block_ids) == (32, [0, 1, 4])
    h.m.free_table(a2.table)
    assert h.m.evict(4) == [3, 2, 1, 0]


def test_eviction_order_without_reuse(h):
    a = h.prefill(1, toks(1000, 32))
    h.m.free_table(a.table)
    b = h.prefill(2, toks(2000, 32))
    h.m.free_table(b.table)
    assert h.m.evict(10) == [1, 0, 3, 2]
    assert h.m.usage().free == 11 and len(h.m.index) == 0


def test_evict_with_nothing_cached_takes_nothing(h):
    """Held blocks of every kind (published and held, forked, pinned, mid swap-out) are never
    eviction candidates: with no CACHED block, evict takes nothing and changes nothing."""
    a = h.prefill(1, toks(1000, 40))  # blocks 0, 1 published and held, 2 partial
    h.m.fork(a.table, 2)
    snap = h.m.snapshot(a.table)
    c = h.prefill(3, toks(3000, 20))
    h.m.begin_evict(c.table)
    before, free, evictions = h.refs(), list(h.m.pool.free_ids), h.m.stats.evictions
    assert h.m.usage().cached == 0
    assert h.m.evict(4) == []
    assert (h.refs(), list(h.m.pool.free_ids), h.m.stats.evictions) == (before, free, evictions)
    h.m.release_snapshot(snap)


def test_parent_outlives_every_child_branch(h):
    a = h.prefill(1, toks(1000, 48))
    b = h.prefill(2, toks(1000, 16) + toks(2000, 32))
    assert b.table.block_ids == [0, 3, 4]
    h.m.free_table(a.table)
    h.m.free_table(b.table)
    assert h.m.index.evictable_leaves() == [2, 4]
    assert h.m.evict(5) == [2, 1, 4, 3, 0]


def test_failed_allocation_changes_nothing(h):
    a = h.prefill(1, toks(1000, 48))
    h.m.free_table(a.table)
    h.prefill(2, toks(2000, 80))  # holds 3..7
    assert (h.m.pool.num_free, h.m.num_free_blocks()) == (3, 6)
    c_table = h.m.new_table(3)
    chain = h.m.new_key_chain(h.ns)
    chain.extend(toks(3000, 112))
    assert h.m.acquire_prefix(c_table, chain, 112) == 0
    before = (h.refs(), list(h.m.pool.free_ids), dict(h.m.index.entries), c_table.epoch)
    assert not h.m.can_append(c_table, 112)
    with pytest.raises(OutOfBlocks):
        h.m.append_slots(c_table, 112)
    after = (h.refs(), list(h.m.pool.free_ids), dict(h.m.index.entries), c_table.epoch)
    assert before == after
    assert c_table.block_ids == [] and h.m.stats.evictions == 0
    assert h.m.can_append(c_table, 96)
    assert len(h.m.append_slots(c_table, 96)) == 96
    assert c_table.block_ids == [8, 9, 10, 2, 1, 0]


def test_failed_allocation_after_prefix_hit_keeps_hit_refs(h):
    h.prefill(1, toks(1000, 48))
    h.prefill(2, toks(2000, 96))  # 6 blocks; 2 free left
    t = h.m.new_table(3)
    chain = h.m.new_key_chain(h.ns)
    chain.extend(toks(1000, 32) + toks(4000, 40))
    assert h.m.acquire_prefix(t, chain, 72) == 32
    before = h.refs()
    with pytest.raises(OutOfBlocks):
        h.m.append_slots(t, 40)  # needs 3
    assert h.refs() == before
    h.m.free_table(t)
    assert [h.m.pool.blocks[i].ref_count for i in (0, 1)] == [1, 1]


def test_prefix_caching_disabled(make_harness):
    h = make_harness(enable_prefix_caching=False)
    h.prefill(1, A50)
    b = h.prefill(2, A50)
    assert b.cached == 0 and len(h.m.index) == 0
    assert h.m.stats.queries_tokens == 100


def test_namespace_kill_switch(h, make_ns):
    h.prefill(1, A50)
    h.m.set_namespace_enabled(h.ns.digest(), False)
    assert h.prefill(2, A50).cached == 0
    assert h.m.stats.hit_tokens == 0
    other = make_ns(cache_salt="tenant-b")
    c = h.prefill(3, A50[:20], namespace=other)
    assert c.cached == 0 and c.table.num_published == 1  # other namespaces keep caching
    h.m.set_namespace_enabled(h.ns.digest(), True)
    assert h.prefill(4, A50).cached == 48


def test_namespaces_never_share(h, make_ns):
    h.prefill(1, A50[:40])
    for i, other in enumerate(
        [make_ns(cache_salt="x"), make_ns(adapter=""), make_ns(kv_dtype="bfloat16")]
    ):
        s = h.prefill(10 + i, A50[:40], namespace=other)
        assert s.cached == 0
        h.m.free_table(s.table)
    assert h.prefill(20, A50[:40]).cached == 32


def test_decode_publishes_blocks_as_they_fill(h):
    s = h.prefill(1, toks(1000, 30))
    assert s.table.num_published == 1
    h.decode(s, [7])
    h.decode(s, [8])
    assert s.table.num_published == 2 and s.table.block_ids == [0, 1]
    h.decode(s, [9])
    assert s.table.block_ids == [0, 1, 2]
    t = h.prefill(2, s.tokens + [5])
    assert (t.cached, t.table.block_ids) == (32, [0, 1, 3])


def test_slots_are_block_times_size_plus_offset(h):
    h.prefill(1, toks(1000, 16))
    s = h.prefill(2, toks(2000, 20))
    assert s.table.block_ids == [1, 2]
    assert h.decode(s, [1, 2]) == [2 * 16 + 4, 2 * 16 + 5]
