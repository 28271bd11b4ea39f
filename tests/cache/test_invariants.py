"""The invariant checker (R22) must fail on each kind of broken state, with the facts in the message."""

import pytest

from kvpage.cache import BlockState, check_invariants
from kvpage.errors import InvariantViolation


@pytest.fixture
def busy(h):
    """Two sequences sharing a published block, one cached chain, one in-flight snapshot."""
    a = h.prefill(1, list(range(40)))
    b = h.prefill(2, list(range(16)) + [9] * 10)
    c = h.prefill(3, list(range(500, 548)))
    h.m.free_table(c.table)
    snap = h.m.snapshot(b.table)
    h.m.check_invariants()
    return h, a, b, snap


def broken(h, match):
    with pytest.raises(InvariantViolation, match=match):
        h.m.check_invariants()


def test_healthy_state_passes(busy):
    h, a, b, snap = busy
    check_invariants(h.m.pool, [a.table, b.table], h.m.index, [snap])


def test_missing_snapshot_reference_is_caught(busy):
    h, a, b, snap = busy
    with pytest.raises(InvariantViolation, match="pins 1 but 0 in-flight"):
        check_invariants(h.m.pool, [a.table, b.table], h.m.index, [])


def test_ref_count_drift(busy):
    h, *_ = busy
    h.m.pool.blocks[0].ref_count += 1
    broken(h, "block 0: ref_count 4 != owners 2 \\+ pins 1")


def test_referenced_block_on_free_list(busy):
    h, a, *_ = busy
    h.m.pool.free_ids.append(a.table.block_ids[2])
    broken(h, "on the free list with ref_count")


def test_stale_index_entry_after_missed_generation_bump(busy):
    h, *_ = busy
    cached = next(b for b in h.m.pool.blocks if b.state is BlockState.CACHED)
    cached.generation += 1
    broken(h, f"index entry for block {cached.block_id}: generation 0 but block is at 1 \\(freed block")


def test_table_reaching_a_free_block(busy):
    h, a, *_ = busy
    a.table.block_ids.append(h.m.pool.free_ids[0])
    a.table.num_tokens += 16
    broken(h, "reaches a FREE block")


def test_valid_len_beyond_block_size(busy):
    h, a, *_ = busy
    h.m.pool.blocks[a.table.block_ids[2]].valid_len = 17
    broken(h, "valid_len 17 outside")


def test_state_disagrees_with_owners(busy):
    h, a, *_ = busy
    blk = h.m.pool.blocks[a.table.block_ids[2]]
    blk.owners.add(99)
    blk.ref_count += 1
    broken(h, "owners \\[1, 99\\] but held by tables \\[1\\]")


def test_usage_counts_must_sum(busy):
    h, *_ = busy
    h.m.pool.counts[BlockState.FREE] += 1
    broken(h, "state counts sum to 12 != total 11")


def test_debug_mode_checks_after_each_operation(h):
    a = h.prefill(1, list(range(20)))
    h.m.pool.blocks[0].ref_count += 5
    with pytest.raises(InvariantViolation):
        h.decode(a, [1])
