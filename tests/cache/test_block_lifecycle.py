"""Block pool states and transitions, copy-on-write, snapshots (R12) and the swap states (R11)."""

import itertools

import pytest

from kvpage.cache import LEGAL_TRANSITIONS, BlockPool, BlockState
from kvpage.errors import InvariantViolation, OutOfBlocks

S = BlockState


# --- pool -------------------------------------------------------------------------------------
def test_every_illegal_transition_raises_with_names():
    pool = BlockPool(1, 16)
    b = pool.blocks[0]
    illegal = [(f, t) for f, t in itertools.product(S, S)
               if f is not t and t not in LEGAL_TRANSITIONS[f]]
    assert len(illegal) == 30 - sum(len(v) for v in LEGAL_TRANSITIONS.values())
    for frm, to in illegal:
        b.state = frm
        with pytest.raises(InvariantViolation, match=f"block 0: illegal transition "
                                                     f"{frm.name} -> {to.name}"):
            pool._transition(b, to)


def test_operations_in_the_wrong_state_raise():
    pool = BlockPool(4, 16)
    with pytest.raises(InvariantViolation, match="block 3: illegal transition FREE -> EVICTING"):
        pool.begin_evict(3)
    (bid,) = pool.allocate(1, owner=7)
    with pytest.raises(InvariantViolation, match="PRIVATE_WRITABLE -> PRIVATE_WRITABLE.*RESTORING"):
        pool.finish_restore(bid)
    with pytest.raises(InvariantViolation, match="does not hold"):
        pool.remove_owner(bid, 8)
    with pytest.raises(InvariantViolation, match="already holds"):
        pool.add_owner(bid, 7)
    with pytest.raises(InvariantViolation, match="valid_len 17"):
        pool.set_valid(bid, 17)
    with pytest.raises(InvariantViolation, match="cannot publish"):
        pool.mark_published(bid)  # partial
    with pytest.raises(InvariantViolation, match="unpin without a pin"):
        pool.unpin(bid)


def test_allocate_is_atomic_and_free_bumps_generation():
    pool = BlockPool(4, 16)
    assert pool.allocate(3, owner=1) == [0, 1, 2]
    with pytest.raises(OutOfBlocks):
        pool.allocate(2, owner=2)
    assert list(pool.free_ids) == [3] and pool.blocks[3].ref_count == 0
    pool.set_valid(1, 5)
    pool.remove_owner(1, 1)
    b = pool.blocks[1]
    assert (b.state, b.generation, b.valid_len, b.owners) == (S.FREE, 1, 0, set())
    assert list(pool.free_ids) == [3, 1]
    assert pool.usage().free == 2 and pool.usage().private == 2
    assert (pool.stats.allocations, pool.stats.frees, pool.stats.generation_bumps) == (3, 1, 1)


# --- copy-on-write ----------------------------------------------------------------------------
def test_cow_copies_once_for_two_writers(h):
    a = h.prefill(1, list(range(20)))
    assert a.table.block_ids == [0, 1]
    child = h.m.fork(a.table, 2)
    c = type(a)(child, a.chain.copy(), list(a.tokens), 0)
    assert h.m.pool.blocks[1].state is S.SHARED_READONLY and h.m.pool.blocks[1].ref_count == 2
    h.decode(c, [99])  # the child writes first: it copies
    assert c.table.block_ids == [0, 2] and h.kv.copies == [(1, 2)]
    assert h.m.pool.blocks[1].state is S.PRIVATE_WRITABLE
    h.decode(a, [42])  # the parent is now the sole owner: writes in place
    assert a.table.block_ids == [0, 1] and h.m.stats.cow_copies == 1
    assert h.m.pool.blocks[0].ref_count == 2  # the full published block stays shared


def test_make_writable_twice_copies_once(h):
    a = h.prefill(1, list(range(20)))
    child = h.m.fork(a.table, 2)
    epoch = child.epoch
    first = h.m.make_writable(child, 1)
    second = h.m.make_writable(child, 1)
    assert first == second == 2 and h.kv.copies == [(1, 2)] and child.epoch == epoch + 1
    with pytest.raises(InvariantViolation, match="16/16 tokens and cannot be made writable"):
        h.m.make_writable(child, 0)  # full blocks are immutable (KV is append-only)


def test_cow_without_a_free_block_changes_nothing(make_harness):
    h = make_harness(num_blocks=2)
    a = h.prefill(1, list(range(20)))
    child = h.m.fork(a.table, 2)
    before = h.refs()
    assert h.m.blocks_needed(child, 1) == 1 and not h.m.can_append(child, 1)
    with pytest.raises(OutOfBlocks):
        h.m.append_slots(child, 1)
    assert h.refs() == before and h.kv.copies == []


def test_failing_copy_callback_returns_the_new_block(h):
    a = h.prefill(1, list(range(20)))
    child = h.m.fork(a.table, 2)

    def broken(src, dst):
        raise RuntimeError("device copy failed")

    h.m.copy_block_fn = broken
    with pytest.raises(RuntimeError):
        h.m.append_slots(child, 1)
    assert child.block_ids == [0, 1] and child.num_tokens == 20
    assert h.m.pool.blocks[2].state is S.FREE and h.m.pool.blocks[2].generation == 1
    h.m.check_invariants()


# --- snapshots --------------------------------------------------------------------------------
def test_snapshot_pins_blocks_until_released(h):
    a = h.prefill(1, list(range(20)))
    snap = h.m.snapshot(a.table)
    assert snap.block_ids == (0, 1) and snap.epoch == a.table.epoch
    assert [tuple(e) for e in snap.entries] == [(0, 0, 16), (1, 0, 4)]
    h.m.validate_snapshot(snap)
    h.m.free_table(a.table)  # the step is still in flight
    assert [h.m.pool.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    assert h.m.pool.blocks[1].state is S.PRIVATE_WRITABLE and 1 not in h.m.pool.free_ids
    with pytest.raises(InvariantViolation, match="owners"):
        h.m.validate_snapshot(snap)
    with pytest.raises(OutOfBlocks):
        h.prefill(2, list(range(1000, 1000 + 16 * 10)))
    h.m.release_snapshot(snap)
    assert h.m.pool.blocks[1].state is S.FREE and h.m.pool.blocks[1].generation == 1
    assert h.m.pool.blocks[0].state is S.CACHED and h.m.pool.blocks[0].generation == 0
    with pytest.raises(InvariantViolation, match="released twice"):
        h.m.release_snapshot(snap)


def test_pinned_block_is_not_copied_on_pipelined_append(h):
    a = h.prefill(1, list(range(20)))
    snap = h.m.snapshot(a.table)
    h.decode(a, [5])  # the next step's slots are assigned before this step's snapshot is released
    assert a.table.block_ids == [0, 1] and h.m.stats.cow_copies == 0
    assert a.table.epoch > snap.epoch
    h.m.release_snapshot(snap)


def test_snapshot_is_immutable(h):
    a = h.prefill(1, list(range(20)))
    snap = h.m.snapshot(a.table)
    with pytest.raises(AttributeError):
        snap.epoch = 0  # type: ignore[misc]
    assert isinstance(snap.entries, tuple) and isinstance(snap.block_ids, tuple)
    h.m.release_snapshot(snap)


# --- swap states ------------------------------------------------------------------------------
def test_swap_out_and_in(h):
    h.prefill(1, list(range(40)))
    b = h.prefill(2, list(range(32)) + [7] * 8)
    assert b.table.block_ids == [0, 1, 3]
    assert h.m.begin_evict(b.table) == [0, 1, 3]
    states = [h.m.pool.blocks[i].state for i in (0, 1, 3)]
    assert states == [S.SHARED_READONLY, S.SHARED_READONLY, S.EVICTING]
    with pytest.raises(InvariantViolation, match="EVICTING"):
        h.m.snapshot(b.table)
    with pytest.raises(InvariantViolation, match="EVICTING"):
        h.m.append_slots(b.table, 1)
    h.m.free_table(b.table)
    assert h.m.pool.blocks[3].state is S.FREE and h.m.pool.blocks[3].generation == 1
    ids = h.m.allocate_restoring(b.table, 40)
    assert ids == [4, 5, 6] and b.table.num_tokens == 40
    assert [h.m.pool.blocks[i].valid_len for i in ids] == [16, 16, 8]
    assert h.m.usage().restoring == 3
    with pytest.raises(InvariantViolation, match="RESTORING"):
        h.m.snapshot(b.table)  # restored KV must not be visible before the copy is back
    with pytest.raises(InvariantViolation, match="RESTORING"):
        h.m.publish_full_blocks(b.table, b.chain)
    h.m.finish_restore(b.table)
    assert h.m.usage().restoring == 0
    h.m.release_snapshot(h.m.snapshot(b.table))


def test_cancel_evict_and_abort_restore(h):
    a = h.prefill(1, list(range(20)))
    h.m.begin_evict(a.table)
    h.m.cancel_evict(a.table)
    assert h.m.pool.blocks[1].state is S.PRIVATE_WRITABLE
    h.m.free_table(a.table)
    t = h.m.new_table(2)
    h.m.allocate_restoring(t, 20)
    h.m.free_table(t)  # aborted while restoring
    assert h.m.usage().free == 10 and h.m.usage().cached == 1


def test_restore_after_prefix_hit(h):
    h.prefill(1, list(range(40)))
    t = h.m.new_table(2)
    chain = h.m.new_key_chain(h.ns)
    chain.extend(list(range(40)))
    assert h.m.acquire_prefix(t, chain, 40) == 32
    assert h.m.allocate_restoring(t, 8) == [3]
    assert t.block_ids == [0, 1, 3] and t.num_tokens == 40
    h.m.finish_restore(t)
    h.m.append_slots(t, 1)
    assert t.block_ids == [0, 1, 3]


def test_seq_id_cannot_have_two_live_tables(h):
    h.prefill(1, list(range(20)))
    with pytest.raises(InvariantViolation, match="already has a live table"):
        h.m.new_table(1)
