"""KVCacheManager: the one facade the engine uses for paged KV memory.

It composes the pool, the prefix index and per-sequence tables, and is the only code that mutates a
BlockTable. The KV tensors live elsewhere (kvpage.kv): the manager hands out slot indices
(block_id * block_size + offset) and records what the tensors must do as block operations, plain
data drained with `take_block_ops()` into the step's plan: a `CopyBlock` for each copy-on-write,
an `InvalidateBlock` for each block freed when the KV layout keeps per-block state (scales). It
calls nobody back: whoever applies the operations (the engine's executor) does so in order,
before the step's forward pass.

Order of operations for one sequence (engine side):
  chain = new_key_chain(ns); chain.extend(prompt)
  cached = acquire_prefix(table, chain, len(prompt))      # hits first, before any allocation
  slots = append_slots(table, len(prompt) - cached)       # may evict CACHED leaves; atomic
  snap = snapshot(table) ... run the step ... release_snapshot(snap)
  publish_full_blocks(table, chain)                        # only after the step wrote the KV
  free_table(table)                                        # tail first; published blocks -> CACHED

With a hybrid layout (kvpage.cache.groups, which explains the design) every operation also covers
the table's extra groups: window groups trim the blocks out of their window before each append,
hits follow the hybrid rule, snapshots / swaps / forks / CoW cover every group.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpage.cache.block_ops import BlockOp, CopyBlock, InvalidateBlock
from kvpage.cache.block_pool import READABLE, BlockPool, BlockState, CacheUsage
from kvpage.cache.block_table import BlockTable, SnapshotEntry, TableSnapshot, blocks_for
from kvpage.cache.groups import NULL_BLOCK, KVLayout, first_needed_block
from kvpage.cache.invariants import check_invariants
from kvpage.cache.key_chain import BlockKey, BlockKeyChain
from kvpage.cache.namespace import CacheNamespace
from kvpage.cache.prefix_index import DigestMismatch, PrefixIndex, PublishResult
from kvpage.cache.stats import CacheStats
from kvpage.errors import InvariantViolation, OutOfBlocks

_S = BlockState
APPENDABLE = READABLE | {_S.RESTORING}


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        fast_key_bits: int = 64,
        debug_checks: bool = False,
        invalidate_freed: bool = False,
        layout: KVLayout | None = None,
    ):
        self.block_size = block_size
        self.layout = layout
        # Groups 1.. (one table each besides block_ids): their windows, None for a global one.
        self.extra_windows: tuple[int | None, ...] = () if layout is None else layout.extra_windows
        # Group 0's window: None (global, the radix tree) but in an all-windowed model.
        self.window0: int | None = None if layout is None else layout.groups[0].window
        # Some group trims: before each append and swap-out (a plain layout never does).
        self.windowed = self.window0 is not None or any(w is not None for w in self.extra_windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.fast_key_bits = fast_key_bits
        self.debug_checks = debug_checks
        self.stats = CacheStats()
        self.pool = BlockPool(num_blocks, block_size, self.stats)
        # A block's per-generation KV state (a quantized block's scales) dies with it: each free
        # becomes an InvalidateBlock for the KV store. A plain layout keeps none, so no op.
        if invalidate_freed:
            self.pool.on_free = lambda block_id: self._ops.append(InvalidateBlock(block_id))
        self.index = PrefixIndex(self.pool, self.stats, fast_key_bits)
        self.pool.on_cached = self.index.note_cached
        self._ops: list[BlockOp] = []  # block operations since the last take_block_ops()
        self._corruptions: list[tuple[int, DigestMismatch]] = []  # (seq id, what it found)
        self.live_tables: dict[int, BlockTable] = {}  # seq_id -> table holding blocks
        self.inflight: dict[int, TableSnapshot] = {}
        self._next_snap_id = 0

    # --- construction ----------------------------------------------------------------------
    def new_table(self, seq_id: int) -> BlockTable:
        old = self.live_tables.get(seq_id)
        if old is not None and old.block_ids:
            raise InvariantViolation(f"seq {seq_id} already has a live table {old.block_ids}")
        table = BlockTable(seq_id)
        if self.extra_windows:
            table.extra = [[] for _ in self.extra_windows]
            table.trimmed = [0] * len(self.extra_windows)
        self.live_tables[seq_id] = table
        return table

    def new_key_chain(self, namespace: CacheNamespace) -> BlockKeyChain:
        if namespace.block_size != self.block_size:
            raise InvariantViolation(
                f"namespace block_size {namespace.block_size} != cache block_size {self.block_size}"
            )
        return BlockKeyChain(namespace.digest(), self.block_size, self.fast_key_bits)

    # --- prefix hits -----------------------------------------------------------------------
    def acquire_prefix(
        self,
        table: BlockTable,
        chain: BlockKeyChain,
        prompt_len: int,
        max_blocks: int | None = None,
    ) -> int:
        """Take the cached full blocks the prompt starts with (at most `max_blocks` when given)
        and return the tokens they hold."""
        if table.block_ids or table.num_tokens:
            raise InvariantViolation(f"seq {table.seq_id}: acquire_prefix on a non-empty table")
        if not 0 < prompt_len <= chain.num_tokens:
            raise InvariantViolation(
                f"seq {table.seq_id}: prompt_len {prompt_len} but chain knows {chain.num_tokens}"
            )
        self._check_chain(chain)
        table.namespace = chain.namespace_digest
        self.stats.queries_tokens += prompt_len
        if not self._caching_on(chain.namespace_digest):
            return 0
        cap = self.max_hit_blocks(prompt_len)
        if max_blocks is not None:
            cap = min(cap, max_blocks)
        if self.window0 is not None:
            return self._acquire_windowed(table, chain, cap)
        hits = self.index.match(chain, cap)
        extra = self.extra_hits(chain, hits) if self.extra_windows else None
        for found in self.index.take_corruptions():  # the index knows keys, not sequences
            self._corruptions.append((table.seq_id, found))
        if extra is not None:
            hits = hits[: len(extra[0])]
            self._take_extra(table, extra)
        for e in hits:
            self.pool.add_owner(e.block_id, table.seq_id)
        table.block_ids = [e.block_id for e in hits]
        table.num_tokens = len(hits) * self.block_size
        table.num_published = len(hits)
        table.bump()
        self.live_tables[table.seq_id] = table
        self.stats.hit_tokens += table.num_tokens
        self._debug()
        return table.num_tokens

    def extra_hits(self, chain: BlockKeyChain, hits: list) -> list[list[int]]:
        """The hybrid rule (a declared seam, kvpage.engine.hooks): the longest h <= len(hits)
        for which every global group has the prefix [0, h) and every window group the blocks of
        the window at h; per extra group its entries [0, h) (NULL_BLOCK where a window group
        needs none). `hits` are group 0's."""
        h = len(hits)
        found: list[list[int | None]] = []
        for g, window in enumerate(self.extra_windows, start=1):
            ids = [self.lookup_group(chain, d, g) for d in range(h)]
            if window is None:  # the whole prefix, up to the first miss
                h = next((d for d, b in enumerate(ids) if b is None), h)
            found.append(ids)
        h = self._hybrid_hit_len(found, h)
        out = []
        for ids, window in zip(found, self.extra_windows, strict=True):
            lo = (
                0
                if window is None
                else first_needed_block(h * self.block_size, window, self.block_size)
            )
            out.append([NULL_BLOCK] * lo + [b for b in ids[lo:h]])
        return out

    def lookup_group(self, chain: BlockKeyChain, depth: int, group: int) -> int | None:
        """The joinable block layer group `group` published for the chain's block `depth`."""
        key = chain.keys[depth]
        entry = self.index.confirmed(
            key if group == 0 else self.index.group_key(key, group), chain.namespace_digest, depth
        )
        return None if entry is None else entry.block_id

    def _acquire_windowed(self, table: BlockTable, chain: BlockKeyChain, cap: int) -> int:
        """acquire_prefix with a window group 0 (an all-windowed model): group 0 is flat like
        every window group, so the hybrid rule decides for it too."""
        windows = (self.window0, *self.extra_windows)
        found: list[list[int | None]] = []
        h = min(cap, len(chain.keys))
        for g, window in enumerate(windows):
            ids = [self.lookup_group(chain, d, g) for d in range(h)]
            if window is None:
                h = next((d for d, b in enumerate(ids) if b is None), h)
            found.append(ids)
        for found_bad in self.index.take_corruptions():
            self._corruptions.append((table.seq_id, found_bad))
        h = self._hybrid_hit_len(found, h, windows)
        bs = self.block_size
        groups = []
        for ids, window in zip(found, windows, strict=True):
            lo = 0 if window is None else first_needed_block(h * bs, window, bs)
            groups.append([NULL_BLOCK] * lo + [b for b in ids[lo:h]])
        for bid in groups[0]:
            if bid != NULL_BLOCK:
                self.pool.add_owner(bid, table.seq_id)
        table.block_ids = groups[0]
        table.trimmed0 = next((i for i, b in enumerate(groups[0]) if b != NULL_BLOCK), h)
        if table.extra:
            self._take_extra(table, groups[1:])
        table.num_tokens = h * bs
        table.num_published = h
        table.bump()
        self.live_tables[table.seq_id] = table
        self.stats.hit_tokens += table.num_tokens
        self._debug()
        return table.num_tokens

    def _hybrid_hit_len(
        self, found: list[list[int | None]], h: int, windows: tuple[int | None, ...] | None = None
    ) -> int:
        """The largest h' <= h that every window group can serve: the blocks its window needs
        at h' are all present (`windows`: found's groups, the extra groups by default)."""
        bs = self.block_size
        windows = self.extra_windows if windows is None else windows
        while h > 0:
            ok = True
            for ids, window in zip(found, windows, strict=True):
                lo = 0 if window is None else first_needed_block(h * bs, window, bs)
                if len(ids) < h or any(b is None for b in ids[lo:h]):
                    ok = False
                    break
            if ok:
                return h
            h -= 1
        return 0

    def _take_extra(self, table: BlockTable, extra: list[list[int]]) -> None:
        for g, ids in enumerate(extra):
            for bid in ids:
                if bid != NULL_BLOCK:
                    self.pool.add_owner(bid, table.seq_id)
            table.extra[g] = ids
            table.trimmed[g] = next((i for i, b in enumerate(ids) if b != NULL_BLOCK), len(ids))

    def published_block(self, key: BlockKey) -> tuple[int, int] | None:
        """The block published under `key` (its digest confirmed) and its generation, without
        taking it or counting a lookup."""
        entry = self.index.entries.get(key.fast)
        if entry is None or entry.digest != key.digest:
            return None
        return entry.block_id, entry.generation

    def max_hit_blocks(self, prompt_len: int) -> int:
        """Full blocks a prompt may take from the cache: at least one prompt token is left to
        compute, since its logits choose the first output token."""
        return (prompt_len - 1) // self.block_size

    # --- allocation ------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens from position 0."""
        return blocks_for(num_tokens, self.block_size)

    def max_blocks_for(self, num_tokens: int) -> int:
        """The most blocks a table of `num_tokens` tokens can hold over every group (a window
        group holds a whole prompt while it is prefilled)."""
        return self.blocks_for(num_tokens) * (1 + len(self.extra_windows))

    def restore_need(self, num_tokens: int, num_new_tokens: int) -> int:
        """Blocks a swap-in of `num_tokens` tokens and an append of `num_new_tokens` after it
        take, over every group."""
        bs, n = self.block_size, self.blocks_for(num_tokens)
        grow = self.blocks_for(num_tokens + num_new_tokens) - n
        need = n + grow
        if self.window0 is not None:
            need -= first_needed_block(num_tokens, self.window0, bs)
        for w in self.extra_windows:
            need += n - (0 if w is None else first_needed_block(num_tokens, w, bs)) + grow
        return need

    def num_free_blocks(self) -> int:
        return self.pool.num_free + self.index.num_evictable()

    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """New blocks plus one CoW copy if the first new token lands in a shared block."""
        new = self.blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)
        need = max(new, 0) + int(self.cow_needed(table))
        if table.extra:  # every group grows by as many blocks (trimmed ones are not counted)
            need += max(new, 0) * len(table.extra) + self._extra_cows(table)
        return need

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.blocks_needed(table, num_new_tokens) <= self.num_free_blocks()

    def append_slots(self, table: BlockTable, num_new_tokens: int) -> list[int]:
        if num_new_tokens < 0:
            raise InvariantViolation(f"seq {table.seq_id}: append of {num_new_tokens} tokens")
        if num_new_tokens == 0:
            return []
        self.check_appendable(table)
        bs = self.block_size
        start, end = table.num_tokens, table.num_tokens + num_new_tokens
        if self.windowed:
            self.trim(table)  # before reserving: the window's old blocks are this step's room
        cow = self.cow_needed(table)
        new = self.blocks_for(end) - len(table.block_ids)
        extra_cows = self._extra_cows(table) if table.extra else 0
        # all-or-nothing: past this line nothing can run out
        self._reserve(new + int(cow) + new * len(table.extra) + extra_cows)
        if cow:
            self._copy_on_write(table, start // bs)
        if new:
            table.block_ids.extend(self.pool.allocate(new, table.seq_id))
        if table.extra:
            self._append_extra(table, start, end, new)
        slots: list[int] = []
        for j in range(start // bs, len(table.block_ids)):
            bid = table.block_ids[j]
            hi = min(end, (j + 1) * bs)
            self.pool.set_valid(bid, hi - j * bs)
            base = (bid - j) * bs  # slot of position p in this block = base + p
            slots.extend(range(base + max(start, j * bs), base + hi))
        table.num_tokens = end
        table.bump()
        self.live_tables[table.seq_id] = table
        self._debug()
        return slots

    def _append_extra(self, table: BlockTable, start: int, end: int, new: int) -> None:
        """The extra groups' side of append_slots (the room is reserved): CoW of a shared last
        block, the new blocks, valid lengths."""
        bs = self.block_size
        for ids in table.extra:
            if start % bs and self.pool.blocks[ids[-1]].state is _S.SHARED_READONLY:
                self._copy_on_write(table, start // bs, ids)
            if new:
                ids.extend(self.pool.allocate(new, table.seq_id))
            for j in range(start // bs, len(ids)):
                self.pool.set_valid(ids[j], min(end, (j + 1) * bs) - j * bs)

    def _extra_cows(self, table: BlockTable) -> int:
        if table.num_tokens % self.block_size == 0:
            return 0
        blocks = self.pool.blocks
        return sum(blocks[ids[-1]].state is _S.SHARED_READONLY for ids in table.extra)

    def trim(self, table: BlockTable) -> None:
        """Window groups give back the blocks no query from position num_tokens on can see
        (kvpage.cache.groups): published ones go CACHED, the others FREE (a declared seam).
        Position by position over the groups, head first: LRU then evicts the oldest positions
        of every window group alike, and keeps the tails a hit needs in all of them."""
        bs, start = self.block_size, table.num_tokens
        # Every group, group 0 first (a window group only in an all-windowed model).
        tables = [table.block_ids, *table.extra]
        cursors = [table.trimmed0, *table.trimmed]
        windows = (self.window0, *self.extra_windows)
        los = [None if w is None else first_needed_block(start, w, bs) for w in windows]
        first = min((cursors[g] for g, lo in enumerate(los) if lo is not None), default=0)
        last = max((lo for lo in los if lo is not None), default=0)
        for j in range(first, last):
            for g, lo in enumerate(los):
                ids = tables[g]
                if lo is not None and j < lo and ids[j] != NULL_BLOCK:
                    self.pool.remove_owner(ids[j], table.seq_id)
                    ids[j] = NULL_BLOCK
                    self.stats.window_frees += 1
        if los[0] is not None:
            table.trimmed0 = max(los[0], table.trimmed0)
        for g, lo in enumerate(los[1:]):
            if lo is not None:
                table.trimmed[g] = max(lo, table.trimmed[g])

    def make_writable(self, table: BlockTable, logical_block: int) -> int:
        """Copy-on-write of one table entry; returns the (possibly new) block id. Idempotent."""
        bid = table.block_ids[logical_block]
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
        new = self._copy_on_write(table, logical_block)
        table.bump()
        self._debug()
        return new

    def cow_needed(self, table: BlockTable) -> bool:
        """The copy-on-write decision (a declared seam, kvpage.engine.hooks): the next write
        lands in a block others can read. Only a partial last block can receive a write; a full
        one is never written again."""
        if table.num_tokens % self.block_size == 0:
            return False
        return self.pool.blocks[table.block_ids[-1]].state is _S.SHARED_READONLY

    def check_appendable(self, table: BlockTable) -> None:
        """The table's last block is readable, or being restored (a swap-in's copy lands before
        the step that writes after it), and the table holds it: appends go there."""
        for ids in (table.block_ids, *table.extra):
            if not ids or ids[-1] == NULL_BLOCK:  # a window of 1 key gave its last block back
                continue
            b = self.pool.blocks[ids[-1]]
            if b.state not in APPENDABLE or table.seq_id not in b.owners:
                raise InvariantViolation(
                    f"seq {table.seq_id}: append to a table whose last block {b.block_id} is "
                    f"{b.state.name} (owners {sorted(b.owners)})"
                )

    def _copy_on_write(
        self, table: BlockTable, logical_block: int, ids: list[int] | None = None
    ) -> int:
        ids = table.block_ids if ids is None else ids
        src = ids[logical_block]
        dst = self.pool.allocate(1, table.seq_id)[0]
        self._ops.append(CopyBlock(src, dst, table.seq_id, logical_block))
        self.pool.set_valid(dst, self.pool.blocks[src].valid_len)
        ids[logical_block] = dst
        self.pool.remove_owner(src, table.seq_id)
        if ids is table.block_ids:  # one copy-on-write per logical block, however many groups
            self.stats.cow_copies += 1
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

    # --- publishing ------------------------------------------------------------------------
    def publish_full_blocks(self, table: BlockTable, chain: BlockKeyChain) -> None:
        """Publish the table's full blocks whose keys the chain knows. Call after the step that
        wrote their KV has finished: a published block can be read by any sequence at once."""
        self._check_chain(chain)
        if table.namespace is None:
            table.namespace = chain.namespace_digest
        elif table.namespace != chain.namespace_digest:
            raise InvariantViolation(f"seq {table.seq_id}: chain namespace differs from table's")
        if table.publish_blocked or not self._caching_on(chain.namespace_digest):
            return
        full = min(table.num_tokens // self.block_size, len(chain.keys))
        flat0 = self.window0 is not None  # a window group 0 publishes flat, like window extras
        for i in range(table.num_published, full):
            ok = (
                self._publish_flat(table, chain, i, 0)
                if flat0
                else self._publish_one(table, chain, i)
            )
            if not ok or (table.extra and not self._publish_extra(table, chain, i)):
                table.publish_blocked = True
                break
            table.num_published = i + 1
        self._debug()

    def _publish_one(self, table: BlockTable, chain: BlockKeyChain, i: int, group: int = 0) -> bool:
        ids = table.block_ids if group == 0 else table.extra[group - 1]
        bid = ids[i]
        state = self.pool.blocks[bid].state
        if state not in READABLE:
            raise InvariantViolation(f"seq {table.seq_id}: publish of block {bid} in {state.name}")
        parent = None if i == 0 else self.index.by_block.get(ids[i - 1])
        if i > 0 and parent is None:
            return False
        key = chain.keys[i] if group == 0 else self.index.group_key(chain.keys[i], group)
        result = self.index.publish(key, bid, i, parent, chain.namespace_digest)
        return result in (PublishResult.PUBLISHED, PublishResult.ALREADY)

    def _publish_extra(self, table: BlockTable, chain: BlockKeyChain, i: int) -> bool:
        """Block i of every extra group: a global group chains like group 0 (a failure blocks
        later publishes); a window group's entry is flat, published while still held."""
        for g, window in enumerate(self.extra_windows, start=1):
            if window is None:
                if not self._publish_one(table, chain, i, g):
                    return False
                continue
            if not self._publish_flat(table, chain, i, g):
                return False
        return True

    def _publish_flat(self, table: BlockTable, chain: BlockKeyChain, i: int, group: int) -> bool:
        """Block i of a window group, without a parent (its table no longer holds the blocks
        before the window), published while still held."""
        bid = (table.block_ids if group == 0 else table.extra[group - 1])[i]
        if bid == NULL_BLOCK or self.pool.blocks[bid].state not in READABLE:
            return True
        key = chain.keys[i] if group == 0 else self.index.group_key(chain.keys[i], group)
        result = self.index.publish(key, bid, i, None, chain.namespace_digest)
        return result in (PublishResult.PUBLISHED, PublishResult.ALREADY)

    # --- release ---------------------------------------------------------------------------
    def free_table(self, table: BlockTable) -> None:
        # Tail first: the tail gets the oldest release tick, so it is evicted before its prefix.
        for bid in reversed(table.block_ids):
            if bid != NULL_BLOCK:  # only a window group 0 has any
                self.pool.remove_owner(bid, table.seq_id)
        # The extra groups' tails are what a hit of the whole prefix needs (their heads only
        # shorter hits): released last, head first and position by position over the groups
        # (like trim), so they are evicted last and every group's alike.
        for j in range(len(table.block_ids)):
            for ids in table.extra:
                if ids[j] != NULL_BLOCK:
                    self.pool.remove_owner(ids[j], table.seq_id)
        table.reset()
        if self.live_tables.get(table.seq_id) is table:
            del self.live_tables[table.seq_id]
        self._debug()

    def fork(self, table: BlockTable, child_seq_id: int) -> BlockTable:
        """A child sequence sharing every block of `table` (parallel sampling); writes CoW."""
        self.check_appendable(table)
        child = self.new_table(child_seq_id)
        for bid in table.block_ids:
            if bid != NULL_BLOCK:
                self.pool.add_owner(bid, child_seq_id)
        child.block_ids = list(table.block_ids)
        child.trimmed0 = table.trimmed0
        for g, ids in enumerate(table.extra):
            for bid in ids:
                if bid != NULL_BLOCK:
                    self.pool.add_owner(bid, child_seq_id)
            child.extra[g] = list(ids)
        child.trimmed = list(table.trimmed)
        child.num_tokens = table.num_tokens
        child.namespace = table.namespace
        child.num_published = table.num_published
        child.publish_blocked = table.publish_blocked
        child.bump()
        self._debug()
        return child

    # --- snapshots -------------------------------------------------------------------------
    def snapshot(self, table: BlockTable) -> TableSnapshot:
        held0 = [b for b in table.block_ids if b >= 0] if table.trimmed0 else table.block_ids
        blocks = [self.pool.blocks[bid] for bid in held0]
        for i, b in enumerate(blocks):
            if b.state not in READABLE:
                raise InvariantViolation(
                    f"seq {table.seq_id}: snapshot reads block[{i}]={b.block_id} in {b.state.name}"
                )
        extra = self._extra_blocks(table) if table.extra else ()
        for b in blocks:
            self.pool.pin(b.block_id)
        for group in extra:
            for b in group:
                self.pool.pin(b.block_id)
        self._next_snap_id += 1
        extra_ids, extra_entries = (), ()
        if extra:  # one group: nothing more per step
            extra_ids = tuple(tuple(ids) for ids in table.extra)
            extra_entries = tuple(
                tuple(SnapshotEntry(b.block_id, b.generation, b.valid_len) for b in group)
                for group in extra
            )
        snap = TableSnapshot(
            snap_id=self._next_snap_id,
            seq_id=table.seq_id,
            epoch=table.epoch,
            num_tokens=table.num_tokens,
            entries=tuple(SnapshotEntry(b.block_id, b.generation, b.valid_len) for b in blocks),
            block_ids=tuple(table.block_ids),
            extra_block_ids=extra_ids,
            extra_entries=extra_entries,
        )
        self.inflight[snap.snap_id] = snap
        return snap

    def _extra_blocks(self, table: BlockTable) -> list[list]:
        """The held blocks of each extra group, each checked readable."""
        out = []
        for g, ids in enumerate(table.extra, start=1):
            group = [self.pool.blocks[bid] for bid in ids if bid != NULL_BLOCK]
            for b in group:
                if b.state not in READABLE:
                    raise InvariantViolation(
                        f"seq {table.seq_id}: snapshot reads group {g} block {b.block_id} in "
                        f"{b.state.name}"
                    )
            out.append(group)
        return out

    def release_snapshot(self, snap: TableSnapshot) -> None:
        if self.inflight.pop(snap.snap_id, None) is None:
            raise InvariantViolation(f"snapshot {snap.snap_id} of seq {snap.seq_id} released twice")
        for group in snap.extra_entries:
            for e in reversed(group):
                self.pool.unpin(e.block_id)
        for e in reversed(snap.entries):  # tail first, like free_table (LRU ticks)
            self.pool.unpin(e.block_id)
        self._debug()

    def validate_snapshot(self, snap: TableSnapshot) -> None:
        """Every entry still names the same block incarnation, readable and owned by the seq."""
        if snap.snap_id not in self.inflight:
            raise InvariantViolation(f"snapshot {snap.snap_id} of seq {snap.seq_id} not in flight")
        entries = [*snap.entries, *(e for group in snap.extra_entries for e in group)]
        for i, e in enumerate(entries):
            b = self.pool.blocks[e.block_id]
            if (
                b.generation != e.generation
                or b.state not in READABLE
                or snap.seq_id not in b.owners
                or b.valid_len < e.valid_len
            ):
                raise InvariantViolation(
                    f"snapshot {snap.snap_id} seq {snap.seq_id} epoch {snap.epoch} block[{i}]="
                    f"{e.block_id}: expected gen {e.generation} valid {e.valid_len}, pool has gen "
                    f"{b.generation} valid {b.valid_len} {b.state.name} owners {sorted(b.owners)}"
                )

    # --- swap support ----------------------------------------------------------------------
    def begin_evict(self, table: BlockTable) -> list[int]:
        """Mark the table's private blocks EVICTING while their KV is copied out. Returns every
        block id of the table in logical order (shared ones stay readable for their other
        holders but must be copied too). Follow with free_table, or cancel_evict on failure.
        Extra groups: trimmed first, then their held blocks follow group 0's, group by group."""
        if self.windowed:
            self.trim(table)
        held = table.held_ids()
        for bid in held:
            if self.pool.blocks[bid].state is _S.PRIVATE_WRITABLE:
                self.pool.begin_evict(bid)
        table.bump()
        self._debug()
        return held

    def cancel_evict(self, table: BlockTable) -> None:
        for bid in table.held_ids():
            if self.pool.blocks[bid].state is _S.EVICTING:
                self.pool.cancel_evict(bid)
        table.bump()
        self._debug()

    def allocate_restoring(self, table: BlockTable, num_tokens: int) -> list[int]:
        """Append blocks for num_tokens restored tokens in RESTORING state (unreadable until
        finish_restore). The table must end on a block boundary (empty, or after a prefix hit)."""
        if table.num_tokens % self.block_size:
            raise InvariantViolation(f"seq {table.seq_id}: restore after a partial block")
        if num_tokens <= 0:
            raise InvariantViolation(f"seq {table.seq_id}: restore of {num_tokens} tokens")
        n, bs = self.blocks_for(num_tokens), self.block_size
        first, end = len(table.block_ids), table.num_tokens + num_tokens
        los = [
            first if w is None else max(first, first_needed_block(end, w, bs))
            for w in self.extra_windows
        ]
        lo0 = first if self.window0 is None else first_needed_block(end, self.window0, bs)
        lo0 = max(first, lo0)
        self._reserve(first + n - lo0 + sum(first + n - lo for lo in los))
        ids = self._restoring(table, lo0, first + n - lo0, end)
        table.block_ids.extend([NULL_BLOCK] * (lo0 - first) + ids)
        if lo0 > first:
            table.trimmed0 = max(table.trimmed0, lo0)
        for g, lo in enumerate(los):  # the pages begin_evict copied out: same groups, same order
            own = self._restoring(table, lo, first + n - lo, end)
            table.extra[g].extend([NULL_BLOCK] * (lo - first) + own)
            table.trimmed[g] = max(table.trimmed[g], lo)
            ids += own
        table.num_tokens += num_tokens
        table.bump()
        self.live_tables[table.seq_id] = table
        self._debug()
        return ids

    def _restoring(self, table: BlockTable, first: int, n: int, end: int) -> list[int]:
        """n RESTORING blocks for logical blocks first.., valid up to position `end`."""
        ids = self.pool.allocate(n, table.seq_id, _S.RESTORING)
        for j, bid in enumerate(ids, start=first):
            self.pool.set_valid(bid, min(self.block_size, end - j * self.block_size))
        return ids

    def finish_restore(self, table: BlockTable) -> None:
        for bid in table.held_ids():
            if self.pool.blocks[bid].state is _S.RESTORING:
                self.pool.finish_restore(bid)
        table.bump()
        self._debug()

    # --- what the tensors must do, and what lookups found -----------------------------------
    def take_block_ops(self) -> list[BlockOp]:
        """The block operations recorded since the last call, in the order they must be
        applied (a copy reads its source before a later free may invalidate it)."""
        ops, self._ops = self._ops, []
        return ops

    def take_corruptions(self) -> list[tuple[int, DigestMismatch]]:
        """Fast-key hits whose full digest differed (never served), since the last call."""
        found, self._corruptions = self._corruptions, []
        return found

    # --- observability and control ---------------------------------------------------------
    def usage(self) -> CacheUsage:
        return self.pool.usage()

    def set_namespace_enabled(self, namespace_digest: bytes, enabled: bool) -> None:
        """Kill switch: no hits and no publishes in this namespace while disabled.
        Existing entries stay until evicted."""
        self.index.set_enabled(namespace_digest, enabled)

    def check_invariants(self, tables: Iterable[BlockTable] | None = None) -> None:
        tables = self.live_tables.values() if tables is None else tables
        check_invariants(
            self.pool, tables, self.index, self.inflight.values(), self.window0 is not None
        )

    # --- internals -------------------------------------------------------------------------
    def _caching_on(self, namespace: bytes) -> bool:
        return self.enable_prefix_caching and self.index.is_enabled(namespace)

    def _check_chain(self, chain: BlockKeyChain) -> None:
        if chain.block_size != self.block_size or chain.fast_key_bits != self.fast_key_bits:
            raise InvariantViolation(
                f"key chain (block_size {chain.block_size}, fast bits {chain.fast_key_bits}) does "
                f"not match the cache ({self.block_size}, {self.fast_key_bits})"
            )

    def _debug(self) -> None:
        if self.debug_checks:
            self.check_invariants()
