"""Sharing a running request's blocks at admission (R27): the passphrase experiment's strategies.

A new request joins the running request with the longest common prefix, partial last block
included. That is safe only with a reference count and copy-on-write; the experiment compares the
settings, and the verifier plants the middle one (refcount, no CoW) as the `share_partial_no_cow`
mutant. Like a mutant, it changes one engine instance through named seams that fail loudly when
renamed (kvpage.verify.mutants.base)."""

from __future__ import annotations

from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import Sequence
from kvpage.verify.mutants.base import _bind
from kvpage.verify.mutants.cache import _tolerant_release, _unchecked_set_valid, _unguarded_snapshot


def share_running_prefix(engine: LLMEngine, refcount: bool, cow: bool) -> None:
    """Every admission also joins the longest running prefix; without `refcount` the joined
    blocks are held without a reference, without `cow` appends write into them in place."""
    sched, cache = engine.scheduler, engine.cache
    original = sched._acquire_prefix

    def acquire(self, seq):
        original(seq)
        if _join_running_prefix(engine, seq, refcount):
            self._note_prefix(seq)  # tracers see the joined tokens as cached

    _bind(sched, "_acquire_prefix", acquire)
    if not cow:
        _bind(cache, "_cow_needed", lambda self, table: False)
        _unchecked_set_valid(cache.pool)
    if not refcount:  # blocks held without a reference: nothing may check who owns what
        _tolerant_release(cache.pool)
        _unguarded_snapshot(engine)
        _bind(cache, "_check_appendable", lambda self, table: None)


def _join_running_prefix(engine: LLMEngine, seq: Sequence, refcount: bool = True) -> bool:
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
