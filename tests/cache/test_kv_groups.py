"""Layer groups in the cache manager (kvpage.cache.groups), block by block: a window group's trim,
the hybrid prefix-hit rule, swap restore and fork across groups. Block size 4, window 6: a query
at p sees p - 5 .. p, so from position `start` on blocks below (start - 5) // 4 are never read."""

from __future__ import annotations

from kvpage.cache.block_pool import BlockState
from kvpage.cache.groups import NULL_BLOCK, first_needed_block, kv_layout
from kvpage.cache.key_chain import BlockKeyChain
from kvpage.cache.manager import KVCacheManager

BS, W = 4, 6
NS = bytes(32)
LAYOUT = kv_layout(3, (W, W, None), True)  # group 0 global (layer 2), groups 1, 2 local
_S = BlockState


def _manager(num_blocks: int = 48) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, debug_checks=True, layout=LAYOUT)


def _chain(tokens: list[int]) -> BlockKeyChain:
    chain = BlockKeyChain(NS, BS)
    chain.extend(tokens)
    return chain


def _prefill(cache: KVCacheManager, seq_id: int, tokens: list[int]):
    table, chain = cache.new_table(seq_id), _chain(tokens)
    hit = cache.acquire_prefix(table, chain, len(tokens))
    cache.append_slots(table, len(tokens) - hit)
    cache.publish_full_blocks(table, chain)
    return table, chain, hit


def test_first_needed_block_is_the_window_edge():
    assert first_needed_block(5, W, BS) == 0  # sees 0..5
    assert first_needed_block(9, W, BS) == 1  # sees 4..9: block 0 ends at 3
    assert first_needed_block(8, W, BS) == 0  # sees 3..8: position 3 is block 0's
    assert first_needed_block(20, W, BS) == 3  # sees 15..20


def test_trim_gives_back_the_blocks_out_of_the_window_before_allocating():
    cache = _manager()
    table, chain, _ = _prefill(cache, 0, list(range(1, 21)))  # 20 tokens, 5 blocks a group
    local = list(table.groups[1])
    assert all(b != NULL_BLOCK for b in local) and len(local) == 5
    cache.append_slots(table, 1)  # the query at 20 sees 15..20: blocks 0..2 are gone
    assert table.groups[1][:3] == [NULL_BLOCK] * 3 and table.groups[1][3:5] == local[3:]
    assert table.trimmed == [0, 3, 3]
    for bid in local[:3]:  # published: cached, still a hit; no owner
        assert cache.pool.blocks[bid].state is _S.CACHED
    assert len(table.block_ids) == 6 and all(b != NULL_BLOCK for b in table.block_ids)
    assert cache.stats.window_frees == 6
    cache.free_table(table)
    cache.check_invariants()


def test_hit_takes_the_whole_prefix_globally_and_the_window_locally():
    cache = _manager()
    tokens = list(range(1, 21))
    first, _, _ = _prefill(cache, 0, tokens)
    table, _, hit = _prefill(cache, 1, tokens + [99])
    assert hit == 20  # 5 blocks, the cap of a 21-token prompt
    assert table.block_ids[:5] == first.block_ids[:5]
    for g in (1, 2):  # the hit at 20 needs blocks 3, 4 of each window group only
        assert table.groups[g][:3] == [NULL_BLOCK] * 3
        assert table.groups[g][3:5] == first.groups[g][3:5]
    cache.check_invariants()


def test_hit_stops_where_a_window_group_lacks_a_block_of_its_window():
    cache = _manager()
    tokens = list(range(1, 21))
    first, _, _ = _prefill(cache, 0, tokens)
    local = list(first.groups[2])
    cache.free_table(first)
    gone = local[4]  # group 2's block 4 evicted: no hit at 5 blocks
    cache.index.remove(cache.index.by_block[gone])
    cache.pool.evict_cached(gone)
    table, _, hit = _prefill(cache, 1, tokens + [99])
    assert hit == 16  # 4 blocks: the window at 16 needs blocks 2, 3, both cached
    assert table.groups[2][:4] == [NULL_BLOCK, NULL_BLOCK, local[2], local[3]]
    cache.check_invariants()


def test_swap_out_copies_each_groups_window_and_restore_takes_as_many():
    cache = _manager()
    table, _, _ = _prefill(cache, 0, [7] * 3 + list(range(1, 20)))  # 22 tokens
    copied = cache.begin_evict(table)  # trims at 22 first: window blocks 4, 5 only
    assert len(copied) == 6 + 2 + 2
    cache.free_table(table)
    restored = cache.allocate_restoring(table, 22)
    assert len(restored) == len(copied)
    assert table.groups[1][:4] == [NULL_BLOCK] * 4
    cache.finish_restore(table)
    cache.check_invariants()


def test_fork_shares_every_group_and_copies_on_write_per_group():
    cache = _manager()
    table, _, _ = _prefill(cache, 0, list(range(1, 19)))  # 18 tokens: last blocks partial
    child = cache.fork(table, 1)
    assert child.groups == table.groups
    cache.append_slots(child, 1)
    ops = cache.take_block_ops()
    assert len(ops) == 3  # one copy-on-write per group
    assert {op.src for op in ops} == {ids[-1] for ids in table.groups}
    cache.check_invariants()


def test_a_window_of_one_key_restores_no_block_and_appends_after_it():
    """W = 1 at a block boundary: a swap-out copies none of the window group's blocks, the
    restore takes none, and the next append starts the group again."""
    layout = kv_layout(2, (1, None), True)
    cache = KVCacheManager(16, BS, debug_checks=True, layout=layout)
    table, _, _ = _prefill(cache, 0, list(range(1, 9)))  # 8 tokens: blocks 0, 1 full
    copied = cache.begin_evict(table)
    assert copied == table.block_ids  # group 0's two blocks; the window group's are gone
    cache.free_table(table)
    cache.allocate_restoring(table, 8)
    cache.finish_restore(table)
    assert table.groups[1] == [NULL_BLOCK, NULL_BLOCK]
    cache.append_slots(table, 1)  # the query at 8 sees position 8 only
    assert table.groups[1][:2] == [NULL_BLOCK, NULL_BLOCK] and table.groups[1][2] != NULL_BLOCK
    cache.free_table(table)
    cache.check_invariants()


def test_free_releases_full_groups_tail_first_then_window_groups_head_first():
    """LRU then evicts the global group's chain leaf first, then the window groups' oldest
    positions first, every window group alike: their tails, which a whole-prefix hit needs,
    go last."""
    cache = _manager()
    table, _, _ = _prefill(cache, 0, list(range(1, 17)))  # 16 tokens: 4 full blocks a group
    full, windows = list(table.groups[0]), [list(ids) for ids in table.groups[1:]]
    cache.free_table(table)
    by_position = [ids[j] for j in range(4) for ids in windows]
    assert cache.evict(12) == full[::-1] + by_position
    cache.check_invariants()


def test_an_all_window_models_group_0_is_released_head_first_like_any_window_group():
    cache = KVCacheManager(16, BS, debug_checks=True, layout=kv_layout(2, (W, W), True))
    table, _, _ = _prefill(cache, 0, list(range(1, 17)))  # one window group, 4 full blocks
    held = list(table.block_ids)
    cache.free_table(table)
    assert cache.evict(4) == held  # its head first: the tail a whole-prefix hit needs stays
    cache.check_invariants()


def test_every_full_attention_group_bounds_the_hit():
    """Two global groups (layers 0-3 global, 4-5 windowed: pages of 2 layers): blocks 3, 4 of
    the second global group evicted cut the hit at 3 blocks, as the first's would."""
    layout = kv_layout(6, (None, None, None, None, W, W), True)
    assert [g.window for g in layout.groups] == [None, None, W]
    cache = KVCacheManager(64, BS, debug_checks=True, layout=layout)
    tokens = list(range(1, 21))
    first, _, _ = _prefill(cache, 0, tokens)  # 5 full blocks a group
    held = [list(ids) for ids in first.groups]
    cache.free_table(first)
    for gone in (held[1][4], held[1][3]):  # leaf first, as eviction goes
        cache.index.remove(cache.index.by_block[gone])
        cache.pool.evict_cached(gone)
    table, _, hit = _prefill(cache, 1, tokens + [99])
    assert hit == 12  # the window at 12 needs blocks 1, 2 of the window group: both cached
    assert table.groups[0][:3] == held[0][:3] and table.groups[1][:3] == held[1][:3]
    assert table.groups[2][:3] == [NULL_BLOCK, *held[2][1:3]]
    cache.check_invariants()
