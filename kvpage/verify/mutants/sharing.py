"""Sharing a running request's blocks at admission: the passphrase experiment's strategies,
and the broken engine pieces they need.

A new request joins the running request with the longest common prefix, partial last block
included. That is safe only with a reference count and copy-on-write; the experiment compares the
settings (kvpage.experiments.passphrase), and the verifier plants the middle one (refcount, no CoW)
as the `share_partial_no_cow` mutant. Both apply it through the admission's prefix lookup, a
declared seam (kvpage.engine.hooks), and public methods of the cache parts."""

from __future__ import annotations

import itertools

from kvpage.cache.block_table import SnapshotEntry, TableSnapshot
from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import Sequence
from kvpage.verify.mutants.base import bind, plant


def share_running_prefix(engine: LLMEngine, refcount: bool, cow: bool) -> None:
    """Every admission also joins the longest running prefix; without `refcount` the joined
    blocks are held without a reference, without `cow` appends write into them in place."""
    acquire = engine.scheduler.acquire_prefix

    def acquire_and_join(self, seq):
        acquire(seq)
        if _join_running_prefix(engine, seq, refcount):
            self.note_prefix(seq)  # tracers see the joined tokens as cached

    plant(engine, "scheduler.acquire_prefix", acquire_and_join)
    if not cow:
        plant(engine, "cache.cow_needed", lambda self, table: False)
        unchecked_set_valid(engine.cache.pool)
    if not refcount:  # blocks held without a reference: nothing may check who owns what
        tolerant_release(engine.cache.pool)
        unguarded_snapshots(engine)
        bind(engine.cache, "check_appendable", lambda self, table: None)


def unchecked_set_valid(pool) -> None:
    """Writes into any block, shared or not. A block's fill only grows until it is freed, as
    in the honest pool; with several writers in one block, the one behind must not unfill
    what the others wrote (the real bug corrupts the KV, it does not fail the donor's
    publish). Owners cannot tell who writes: without a refcount a writer is not an owner."""

    def set_valid(self, block_id, valid_len):
        b = self.blocks[block_id]
        b.valid_len = max(b.valid_len, valid_len)

    bind(pool, "set_valid", set_valid)


def tolerant_release(pool) -> None:
    """A release by a table that holds no reference is ignored (it never took one)."""
    release = pool.remove_owner

    def remove_owner(self, block_id, owner):
        if owner in self.blocks[block_id].owners:
            release(block_id, owner)

    bind(pool, "remove_owner", remove_owner)


def unguarded_snapshots(engine: LLMEngine) -> None:
    """Snapshots without the readability check or pins (a naive engine has neither)."""
    cache, pool = engine.cache, engine.cache.pool
    snap_ids = itertools.count(1 << 40)  # apart from the manager's own

    def snapshot(self, table):
        entries = tuple(
            SnapshotEntry(b, pool.blocks[b].generation, pool.blocks[b].valid_len)
            for b in table.block_ids
        )
        ids = tuple(table.block_ids)
        snap = TableSnapshot(
            next(snap_ids), table.seq_id, table.epoch, table.num_tokens, entries, ids
        )
        self.inflight[snap.snap_id] = snap
        return snap

    def release_snapshot(self, snap):
        self.inflight.pop(snap.snap_id, None)

    bind(cache, "snapshot", snapshot)
    bind(cache, "release_snapshot", release_snapshot)


def _join_running_prefix(engine: LLMEngine, seq: Sequence, refcount: bool) -> bool:
    B = engine.config.block_size
    table = seq.table
    if table.num_tokens % B:
        return False
    donor, common = _longest_running_match(engine, seq)
    if donor is None or common <= table.num_tokens:
        return False
    table.publish_blocked = True  # the joined blocks are the donor's to publish
    for logical in range(len(table.block_ids), (common - 1) // B + 1):
        bid = donor.table.block_ids[logical]
        if refcount:
            engine.cache.pool.add_owner(bid, seq.seq_id)
        table.block_ids.append(bid)
    table.num_tokens = common
    table.bump()
    seq.num_computed = common
    engine.cache.live_tables[seq.seq_id] = table
    return True


def _longest_running_match(engine: LLMEngine, seq: Sequence) -> tuple[Sequence | None, int]:
    mine = seq.token_at(0, seq.num_tokens - 1)  # at least one token is left to compute
    best, best_len = None, 0
    for other in engine.scheduler.running:
        if other.chain.namespace_digest != seq.chain.namespace_digest:
            continue
        theirs = other.token_at(0, other.num_computed)
        n = 0
        for a, b in zip(mine, theirs, strict=False):
            if a != b:
                break
            n += 1
        if n > best_len:
            best, best_len = other, n
    return best, best_len
