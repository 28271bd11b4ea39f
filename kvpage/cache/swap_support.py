"""Swap support of the cache manager (kvpage.cache.manager): a preempted sequence's blocks
copied out (EVICTING, then given back) and its table rebuilt for the copy back (RESTORING, then
readable). Every layer group alike: a swap-out trims the window groups first and copies every
group's held pages, group by group; the restore takes as many pages again, in the same order."""

from __future__ import annotations

from collections.abc import Callable

from kvpage.cache.block_pool import BlockPool, BlockState
from kvpage.cache.block_table import BlockTable
from kvpage.cache.group_managers import LayerGroupManager
from kvpage.cache.groups import NULL_BLOCK
from kvpage.errors import InvariantViolation

_S = BlockState


class SwapSupport:
    """The swap half of KVCacheManager, which provides these."""

    block_size: int
    pool: BlockPool
    managers: tuple[LayerGroupManager, ...]  # one per layer group
    windowed: bool
    live_tables: dict[int, BlockTable]
    blocks_for: Callable[[int], int]
    trim: Callable[[BlockTable], None]
    _reserve: Callable[[int], None]
    _debug: Callable[[], None]

    def restore_need(self, num_tokens: int, num_new_tokens: int) -> int:
        """Blocks a swap-in of `num_tokens` tokens and an append of `num_new_tokens` after it
        take, over every group."""
        n = self.blocks_for(num_tokens)
        grow = self.blocks_for(num_tokens + num_new_tokens) - n
        return sum(n - m.first_kept(num_tokens) + grow for m in self.managers)

    def begin_evict(self, table: BlockTable) -> list[int]:
        """Mark the table's private blocks EVICTING while their KV is copied out. Returns every
        block the table holds, group by group in logical order (shared ones stay readable for
        their other holders but must be copied too); window groups trim first. Follow with
        free_table, or cancel_evict on failure."""
        if self.windowed:
            self.trim(table)
        held = table.held_ids()
        self._move_held(table, _S.PRIVATE_WRITABLE, self.pool.begin_evict)
        return held

    def cancel_evict(self, table: BlockTable) -> None:
        self._move_held(table, _S.EVICTING, self.pool.cancel_evict)

    def allocate_restoring(self, table: BlockTable, num_tokens: int) -> list[int]:
        """Append blocks for num_tokens restored tokens in RESTORING state (unreadable until
        finish_restore), in every group the pages begin_evict copied out: the same groups, the
        same order. The table must end on a block boundary (empty, or after a prefix hit)."""
        if table.num_tokens % self.block_size:
            raise InvariantViolation(f"seq {table.seq_id}: restore after a partial block")
        if num_tokens <= 0:
            raise InvariantViolation(f"seq {table.seq_id}: restore of {num_tokens} tokens")
        first, end = len(table.block_ids), table.num_tokens + num_tokens
        last = first + self.blocks_for(num_tokens)
        los = [max(first, m.first_kept(end)) for m in self.managers]
        self._reserve(sum(last - lo for lo in los))
        ids: list[int] = []
        for g, lo in enumerate(los):
            own = self.pool.allocate(last - lo, table.seq_id, _S.RESTORING)
            for j, bid in enumerate(own, start=lo):
                self.pool.set_valid(bid, min(self.block_size, end - j * self.block_size))
            table.groups[g].extend([NULL_BLOCK] * (lo - first) + own)
            if lo > first:
                table.trimmed[g] = max(table.trimmed[g], lo)
            ids += own
        table.num_tokens = end
        table.bump()
        self.live_tables[table.seq_id] = table
        self._debug()
        return ids

    def finish_restore(self, table: BlockTable) -> None:
        self._move_held(table, _S.RESTORING, self.pool.finish_restore)

    def _move_held(self, table: BlockTable, state: BlockState, move) -> None:
        """`move` every block the table holds in `state` (a swap's step for the table)."""
        for bid in table.held_ids():
            if self.pool.blocks[bid].state is state:
                move(bid)
        table.bump()
        self._debug()
