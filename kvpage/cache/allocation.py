"""Room in every layer group (the allocation half of kvpage.cache.manager): the blocks an append
needs, the append itself (all-or-nothing), the window groups' trim before it, copy-on-write of a
shared last block, and eviction of CACHED leaves to make room. Every group of a table grows by
as many blocks; a window group gives back what its window no longer reaches first, so its pages
are this very step's room."""

from __future__ import annotations

from collections.abc import Callable

from kvpage.cache.block_ops import BlockOp, CopyBlock
from kvpage.cache.block_pool import READABLE, BlockPool, BlockState
from kvpage.cache.block_table import BlockTable, blocks_for
from kvpage.cache.group_managers import LayerGroupManager
from kvpage.cache.groups import NULL_BLOCK
from kvpage.cache.prefix_index import PrefixIndex
from kvpage.cache.stats import CacheStats
from kvpage.errors import InvariantViolation, OutOfBlocks

_S = BlockState
APPENDABLE = READABLE | {_S.RESTORING}


class Allocation:
    """The allocation half of KVCacheManager, which provides these."""

    block_size: int
    stats: CacheStats
    pool: BlockPool
    index: PrefixIndex
    managers: tuple[LayerGroupManager, ...]  # one per layer group
    windowed: bool
    live_tables: dict[int, BlockTable]
    _ops: list[BlockOp]
    _debug: Callable[[], None]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens from position 0."""
        return blocks_for(num_tokens, self.block_size)

    def max_blocks_for(self, num_tokens: int) -> int:
        """The most blocks a table of `num_tokens` tokens can hold over every group (a window
        group holds a whole prompt while it is prefilled)."""
        return self.blocks_for(num_tokens) * len(self.managers)

    def num_free_blocks(self) -> int:
        return self.pool.num_free + self.index.num_evictable()

    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """New blocks in every group plus one CoW copy per group whose next write lands in a
        shared block (trimmed entries are not counted)."""
        new = self.blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)
        cows = len(self._shared_last(table)) if self.cow_needed(table) else 0
        return max(new, 0) * len(self.managers) + cows

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.blocks_needed(table, num_new_tokens) <= self.num_free_blocks()

    def append_slots(self, table: BlockTable, num_new_tokens: int) -> list[int]:
        """Room for `num_new_tokens` more tokens in every group; returns their slots in group
        0's pages (the runner maps the other groups' from the step's snapshot)."""
        if num_new_tokens < 0:
            raise InvariantViolation(f"seq {table.seq_id}: append of {num_new_tokens} tokens")
        if num_new_tokens == 0:
            return []
        self.check_appendable(table)
        bs = self.block_size
        start, end = table.num_tokens, table.num_tokens + num_new_tokens
        if self.windowed:
            self.trim(table)  # before reserving: the window's old blocks are this step's room
        cows = self._shared_last(table) if self.cow_needed(table) else ()
        groups = table.groups
        new = self.blocks_for(end) - len(groups[0])
        self._reserve(new * len(self.managers) + len(cows))  # past this line nothing runs out
        if cows:
            self.stats.cow_copies += 1  # one copy-on-write per logical block, however many groups
        for g, ids in enumerate(groups):
            if cows and g in cows:
                self._copy_on_write(table, g, start // bs)
            if new:
                ids.extend(self.pool.allocate(new, table.seq_id))
            for j in range(start // bs, len(ids)):
                self.pool.set_valid(ids[j], min(end, (j + 1) * bs) - j * bs)
        table.num_tokens = end
        slots: list[int] = []
        ids = groups[0]  # the slots the runner writes group 0's pages at
        for j in range(start // bs, len(ids)):
            base = (ids[j] - j) * bs  # slot of position p in this block = base + p
            slots.extend(range(base + max(start, j * bs), base + min(end, (j + 1) * bs)))
        table.bump()
        self.live_tables[table.seq_id] = table
        self._debug()
        return slots

    def roll_back(self, table: BlockTable, num_tokens: int) -> None:
        """Give back the slots past `num_tokens` that the last append assigned (a speculative
        step's rejected drafts, kvpage.engine.speculation): every group's blocks past them are
        freed and the last kept block's valid length shrinks. Only slots of the last append can
        go: the kept blocks are the ones it wrote into, so each is this table's own. Nothing is
        published past `num_tokens` (publishing runs after the roll-back)."""
        if not table.num_published * self.block_size <= num_tokens <= table.num_tokens:
            raise InvariantViolation(
                f"seq {table.seq_id}: roll back to {num_tokens} of {table.num_tokens} tokens "
                f"({table.num_published} blocks published)"
            )
        keep = self.blocks_for(num_tokens)
        for ids in table.groups:
            for bid in ids[keep:]:
                if bid != NULL_BLOCK:
                    self.pool.remove_owner(bid, table.seq_id)
            del ids[keep:]
            if ids and num_tokens % self.block_size and ids[-1] != NULL_BLOCK:
                self.pool.set_valid(ids[-1], num_tokens - (keep - 1) * self.block_size)
        table.num_tokens = num_tokens
        table.bump()
        self._debug()

    def trim(self, table: BlockTable) -> None:
        """Window groups give back the blocks no query from position num_tokens on can see
        (kvpage.cache.groups): published ones go CACHED, the others FREE (a declared seam).
        Position by position over the groups, head first: LRU then evicts the oldest positions
        of every window group alike, and keeps the tails a hit needs in all of them."""
        los = [m.first_kept(table.num_tokens) for m in self.managers]
        cursors = table.trimmed
        first = min((c for c, lo in zip(cursors, los, strict=True) if lo > c), default=0)
        for j in range(first, max(los)):
            for ids, lo in zip(table.groups, los, strict=True):
                if j < lo and ids[j] != NULL_BLOCK:
                    self.pool.remove_owner(ids[j], table.seq_id)
                    ids[j] = NULL_BLOCK
                    self.stats.window_frees += 1
        table.trimmed = [max(lo, c) for c, lo in zip(cursors, los, strict=True)]

    def make_writable(self, table: BlockTable, logical_block: int, group: int = 0) -> int:
        """Copy-on-write of one table entry; returns the (possibly new) block id. Idempotent."""
        bid = table.groups[group][logical_block]
        block = self.pool.blocks[bid]
        if block.state is _S.PRIVATE_WRITABLE:
            return bid
        if block.state is not _S.SHARED_READONLY or block.valid_len == self.block_size:
            # KV is append-only, so only a partial block can ever be written. Copying a full block
            # would also let holders of the same block disagree on its prefix, which breaks the
            # radix rule "every holder of a child holds its parent" (see prefix_index).
            raise InvariantViolation(
                f"seq {table.seq_id}: block {bid} is {block.state.name} with "
                f"{block.valid_len}/{self.block_size} tokens and cannot be made writable"
            )
        self._reserve(1)
        new = self._copy_on_write(table, group, logical_block)
        self.stats.cow_copies += 1
        table.bump()
        self._debug()
        return new

    def cow_needed(self, table: BlockTable) -> bool:
        """The copy-on-write decision (a declared seam, kvpage.engine.hooks): the next write
        lands in a block others can read, in some group. Only a partial last block can receive
        a write; a full one is never written again."""
        if table.num_tokens % self.block_size == 0:
            return False
        blocks = self.pool.blocks
        for ids in table.groups:
            if ids and ids[-1] >= 0 and blocks[ids[-1]].state is _S.SHARED_READONLY:
                return True
        return False

    def _shared_last(self, table: BlockTable) -> list[int]:
        """The groups whose last block others can read: the next write copies it first."""
        blocks = self.pool.blocks
        return [
            g
            for g, ids in enumerate(table.groups)
            if ids and ids[-1] >= 0 and blocks[ids[-1]].state is _S.SHARED_READONLY
        ]

    def check_appendable(self, table: BlockTable) -> None:
        """The table's last block is readable, or being restored (a swap-in's copy lands before
        the step that writes after it), and the table holds it: appends go there."""
        for ids in table.groups:
            if not ids or ids[-1] == NULL_BLOCK:  # a window of 1 key gave its last block back
                continue
            b = self.pool.blocks[ids[-1]]
            if b.state not in APPENDABLE or table.seq_id not in b.owners:
                raise InvariantViolation(
                    f"seq {table.seq_id}: append to a table whose last block {b.block_id} is "
                    f"{b.state.name} (owners {sorted(b.owners)})"
                )

    def _copy_on_write(self, table: BlockTable, group: int, logical_block: int) -> int:
        ids = table.groups[group]
        src = ids[logical_block]
        dst = self.pool.allocate(1, table.seq_id)[0]
        self._ops.append(CopyBlock(src, dst, table.seq_id, logical_block))
        self.pool.set_valid(dst, self.pool.blocks[src].valid_len)
        ids[logical_block] = dst
        self.pool.remove_owner(src, table.seq_id)
        return dst

    def _reserve(self, n: int) -> None:
        """Make n blocks FREE (evicting LRU CACHED leaves) or raise with nothing changed."""
        if n > self.num_free_blocks():
            u = self.pool.usage()
            raise OutOfBlocks(f"need {n} blocks; {u.free} free + {u.cached} cached evictable")
        while self.pool.num_free < n:
            self.index.evict_one()

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to num_blocks CACHED blocks, leaf-first LRU; returns them (now FREE)."""
        out = []
        while len(out) < num_blocks and self.index.num_evictable():
            out.append(self.index.evict_one())
        self._debug()
        return out
