"""Generation mutants: bugs in the block lifecycle that need not change a single token.
A freed block that keeps its generation, or a step that reads an incarnation nobody wrote for it,
only shows in the output once the block has been reused by the wrong request at the wrong moment;
the KV provenance check (kvpage.verify.provenance) sees the (block, generation) pairs themselves,
so it catches both on workloads where every token still equals the reference."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.cache.block_pool import BlockState
from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import Mutant, bind, plant
from kvpage.verify.mutants.cache import keep_generation_on_free

_S = BlockState


def free_without_generation_bump(engine: LLMEngine) -> None:
    """Free puts the block on the free list with its generation unchanged: the next owner's
    incarnation cannot be told from the last one's (a stale snapshot or index entry would pass
    every generation check)."""
    keep_generation_on_free(engine.cache.pool)


@dataclass(slots=True)
class _FreedTail:
    block_id: int
    logical: int
    computed: int  # tokens whose KV the sequence had when it was preempted


def reclaim_freed_tail(engine: LLMEngine) -> None:
    """A 'cheap resume' after recompute preemption: the request takes its freed partial tail block
    back when the block is still FREE, and skips recomputing it. It checks the state but not the
    generation, so it reads a freed incarnation — the KV is right only because nobody happened to
    allocate, write and free that block again in between."""
    sched, cache = engine.scheduler, engine.cache
    tails: dict[int, _FreedTail] = {}
    original_preempt, original_acquire = sched.preempt, sched.acquire_prefix

    def preempt(self, seq, plan, mode=None):
        ids, computed = list(seq.table.block_ids), seq.num_computed
        used = original_preempt(seq, plan, mode)
        if used == "recompute" and ids and computed % cache.block_size:
            tails[seq.seq_id] = _FreedTail(ids[-1], len(ids) - 1, computed)
        return used

    def acquire(self, seq):
        original_acquire(seq)
        tail = tails.pop(seq.seq_id, None)
        if tail is not None and _take_back(cache, seq, tail):
            self.note_prefix(seq)

    bind(sched, "preempt", preempt)
    plant(engine, "scheduler.acquire_prefix", acquire)


def _take_back(cache, seq, tail: _FreedTail) -> bool:
    """Append the freed tail to a table whose prefix hit ends right before it."""
    pool, table, B = cache.pool, seq.table, cache.block_size
    block = pool.blocks[tail.block_id]
    if block.state is not _S.FREE or table.num_tokens != tail.logical * B:
        return False
    pool.free_ids.remove(tail.block_id)
    pool.free_ids.appendleft(tail.block_id)  # so the next allocation is exactly this block
    pool.allocate(1, table.seq_id)
    pool.set_valid(tail.block_id, tail.computed - tail.logical * B)
    table.block_ids.append(tail.block_id)
    # No hit is counted: a re-admission is not a new lookup, so the bug shows in the KV it reads
    # and nowhere else.
    table.num_tokens = tail.computed
    table.bump()
    cache.live_tables[table.seq_id] = table
    seq.num_computed = tail.computed
    return True


GENERATION_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "free_without_generation_bump",
        "a freed block keeps its generation",
        "block_table",
        free_without_generation_bump,
    ),
    Mutant(
        "reclaim_freed_tail",
        "recompute resume takes its freed tail block back without a generation check",
        "restore",
        reclaim_freed_tail,
    ),
)
