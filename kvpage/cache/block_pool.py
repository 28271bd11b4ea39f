"""The block pool: sole owner of per-block metadata and state.

A block's state follows from who holds it:
- FREE: on the free list, ref_count 0, no valid tokens.
- PRIVATE_WRITABLE: one owning table, not published; the only state that may be written in place.
- SHARED_READONLY: two or more owning tables, or published in the prefix index; writes need CoW.
- CACHED: published, ref_count 0; evictable (leaf-first LRU, see prefix_index) and still hit-able.
- EVICTING: being copied out for swap; not writable, not snapshot-able; goes FREE when released.
- RESTORING: allocated for a swap-in whose KV is not back yet; not readable until finish_restore.

ref_count = owning tables + pins of in-flight snapshots. Pins keep a block from being freed but
never make it "shared": a step that still reads a block does not force its owner to copy it. A block
whose last owner left while pinned stays in its state (unreachable from any table) until unpinned.

Every state change goes through `_transition`, checked against `LEGAL_TRANSITIONS`.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.cache.stats import CacheStats
from kvpage.errors import InvariantViolation, OutOfBlocks


class BlockState(enum.Enum):
    FREE = "free"
    PRIVATE_WRITABLE = "private_writable"
    SHARED_READONLY = "shared_readonly"
    CACHED = "cached"
    EVICTING = "evicting"
    RESTORING = "restoring"

    # Members are singletons compared by identity, so identity's hash is theirs; Enum's own
    # hashes the name in Python, and every state change and readability test hashes a state.
    __hash__ = object.__hash__


_S = BlockState
LEGAL_TRANSITIONS: dict[BlockState, frozenset[BlockState]] = {
    _S.FREE: frozenset({_S.PRIVATE_WRITABLE, _S.RESTORING}),
    # PRIVATE -> CACHED is absent: publishing makes a block SHARED first.
    _S.PRIVATE_WRITABLE: frozenset({_S.SHARED_READONLY, _S.FREE, _S.EVICTING}),
    # SHARED -> FREE is absent: an unpublished shared block passes through PRIVATE on its way out.
    _S.SHARED_READONLY: frozenset({_S.PRIVATE_WRITABLE, _S.CACHED}),
    _S.CACHED: frozenset({_S.SHARED_READONLY, _S.FREE}),
    _S.EVICTING: frozenset({_S.FREE, _S.PRIVATE_WRITABLE}),
    _S.RESTORING: frozenset({_S.PRIVATE_WRITABLE, _S.FREE}),
}

# A step may read these, and only these may take a new owner (a CACHED block is re-held through
# the index, which makes it SHARED first).
READABLE = frozenset({_S.PRIVATE_WRITABLE, _S.SHARED_READONLY})


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    pins: int = 0
    generation: int = 0
    valid_len: int = 0
    owners: set[int] = field(default_factory=set)  # seq ids of owning tables
    state: BlockState = BlockState.FREE
    published: bool = False
    last_used: int = 0  # tick of the last release to ref_count 0 (LRU order of CACHED blocks)


@dataclass(frozen=True, slots=True)
class CacheUsage:
    free: int
    private: int
    shared: int
    cached: int
    evicting: int
    restoring: int
    total: int


class BlockPool:
    """Fixed set of blocks; O(1) allocate / release; allocation is all-or-nothing."""

    def __init__(self, num_blocks: int, block_size: int, stats: CacheStats | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.stats = stats if stats is not None else CacheStats()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # reused oldest-freed first
        self.counts = dict.fromkeys(BlockState, 0)
        self.counts[_S.FREE] = num_blocks
        self.on_cached: Callable[[int], None] | None = None  # set by the prefix index owner
        # Told of every block that went FREE, after its generation bump (the manager records
        # an invalidation for the KV store: what the block held, a quantized block's scales).
        self.on_free: Callable[[int], None] | None = None
        self._tick = 0

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def usage(self) -> CacheUsage:
        c = self.counts
        return CacheUsage(
            c[_S.FREE],
            c[_S.PRIVATE_WRITABLE],
            c[_S.SHARED_READONLY],
            c[_S.CACHED],
            c[_S.EVICTING],
            c[_S.RESTORING],
            self.num_blocks,
        )

    # --- allocation ------------------------------------------------------------------------
    def allocate(self, n: int, owner: int, state: BlockState = _S.PRIVATE_WRITABLE) -> list[int]:
        if state not in (_S.PRIVATE_WRITABLE, _S.RESTORING):
            raise InvariantViolation(f"cannot allocate blocks directly into {state.name}")
        if n > len(self.free_ids):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for bid in ids:
            b = self.blocks[bid]
            self._transition(b, state)
            b.owners.add(owner)
            b.ref_count = 1
        self.stats.allocations += n
        return ids

    # --- owners and pins -------------------------------------------------------------------
    def add_owner(self, block_id: int, owner: int) -> None:
        """A table starts holding the block (prefix hit or fork)."""
        b = self.blocks[block_id]
        if b.state not in READABLE and b.state is not _S.CACHED:
            raise InvariantViolation(f"block {block_id}: cannot take a reference in {b.state.name}")
        if owner in b.owners:
            raise InvariantViolation(f"block {block_id}: seq {owner} already holds it")
        b.owners.add(owner)
        b.ref_count += 1
        self._settle(b)

    def remove_owner(self, block_id: int, owner: int) -> None:
        b = self.blocks[block_id]
        if owner not in b.owners:
            raise InvariantViolation(
                f"block {block_id}: seq {owner} releases a block it does not hold "
                f"(owners={sorted(b.owners)}, state={b.state.name})"
            )
        b.owners.remove(owner)
        b.ref_count -= 1
        self._settle(b)

    def pin(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            raise InvariantViolation(f"block {block_id}: pin of an unheld block ({b.state.name})")
        b.pins += 1
        b.ref_count += 1

    def unpin(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.pins == 0:
            raise InvariantViolation(f"block {block_id}: unpin without a pin")
        b.pins -= 1
        b.ref_count -= 1
        if not b.owners:  # pins never decide private vs shared: only a last pin can move it
            self._settle(b)

    # --- content / lifecycle ---------------------------------------------------------------
    def set_valid(self, block_id: int, valid_len: int) -> None:
        b = self.blocks[block_id]
        if b.state not in (_S.PRIVATE_WRITABLE, _S.RESTORING):
            raise InvariantViolation(f"block {block_id}: write into a {b.state.name} block")
        if not 0 <= valid_len <= self.block_size:
            raise InvariantViolation(f"block {block_id}: valid_len {valid_len} > {self.block_size}")
        b.valid_len = valid_len

    def mark_published(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.state not in READABLE or b.published or b.valid_len != self.block_size:
            raise InvariantViolation(
                f"block {block_id}: cannot publish (state={b.state.name}, "
                f"published={b.published}, valid_len={b.valid_len})"
            )
        b.published = True
        self._settle(b)

    def evict_cached(self, block_id: int) -> None:
        """CACHED -> FREE; the caller has already removed the index entry."""
        b = self.blocks[block_id]
        if b.state is not _S.CACHED:
            raise InvariantViolation(f"block {block_id}: evict of a {b.state.name} block")
        b.published = False
        self._to_free(b)
        self.stats.evictions += 1

    def begin_evict(self, block_id: int) -> None:
        self._transition(self.blocks[block_id], _S.EVICTING)

    def cancel_evict(self, block_id: int) -> None:
        self._transition_from(self.blocks[block_id], _S.EVICTING, _S.PRIVATE_WRITABLE)

    def finish_restore(self, block_id: int) -> None:
        self._transition_from(self.blocks[block_id], _S.RESTORING, _S.PRIVATE_WRITABLE)

    # --- internals -------------------------------------------------------------------------
    def _settle(self, b: Block) -> None:
        """Derive the state from owners / pins / published after a reference moved."""
        if b.state in (_S.EVICTING, _S.RESTORING):
            if b.ref_count == 0:
                self._to_free(b)
            return
        if b.ref_count == 0:
            if b.published:
                self._to_cached(b)
            else:
                self._to_free(b)
        elif b.published or len(b.owners) >= 2:
            self._transition(b, _S.SHARED_READONLY)
        elif len(b.owners) == 1:
            self._transition(b, _S.PRIVATE_WRITABLE)
        # owners == 0 with pins left: keep the state until the last pin goes.

    def _to_cached(self, b: Block) -> None:
        if b.state is _S.CACHED:
            raise InvariantViolation(f"block {b.block_id}: already CACHED")
        self._transition(b, _S.CACHED)
        self._tick += 1
        b.last_used = self._tick
        if self.on_cached is not None:
            self.on_cached(b.block_id)

    def _to_free(self, b: Block) -> None:
        if b.state is _S.FREE:
            raise InvariantViolation(f"block {b.block_id}: double free")
        # Bump first so any stale reader (snapshot, index entry) is detectable from now on.
        self._transition(b, _S.FREE)
        b.generation += 1
        b.valid_len = 0
        self.free_ids.append(b.block_id)
        self.stats.generation_bumps += 1
        self.stats.frees += 1
        if self.on_free is not None:
            self.on_free(b.block_id)

    def _transition_from(self, b: Block, frm: BlockState, to: BlockState) -> None:
        """A transition that is only meaningful from one state (FREE -> PRIVATE is legal for an
        allocation, but not as a 'finish_restore')."""
        if b.state is not frm:
            raise InvariantViolation(
                f"block {b.block_id}: illegal transition {b.state.name} -> {to.name} "
                f"(this operation needs {frm.name})"
            )
        self._transition(b, to)

    def _transition(self, b: Block, to: BlockState) -> None:
        if b.state is to:
            return
        if to not in LEGAL_TRANSITIONS[b.state]:
            raise InvariantViolation(
                f"block {b.block_id}: illegal transition {b.state.name} -> {to.name} "
                f"(ref_count={b.ref_count}, owners={sorted(b.owners)}, pins={b.pins})"
            )
        self.counts[b.state] -= 1
        self.counts[to] += 1
        b.state = to
