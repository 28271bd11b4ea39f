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
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpage.cache.block_ops import BlockOp, CopyBlock, InvalidateBlock
from kvpage.cache.block_pool import READABLE, BlockPool, BlockState, CacheUsage
from kvpage.cache.block_table import BlockTable, SnapshotEntry, TableSnapshot, blocks_for
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
    ):
        self.block_size = block_size
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
        hits = self.index.match(chain, cap)
        for found in self.index.take_corruptions():  # the index knows keys, not sequences
            self._corruptions.append((table.seq_id, found))
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

    def num_free_blocks(self) -> int:
        return self.pool.num_free + self.index.num_evictable()

    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """New blocks plus one CoW copy if the first new token lands in a shared block."""
        new = self.blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)
        return max(new, 0) + int(self.cow_needed(table))

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
        cow = self.cow_needed(table)
        new = self.blocks_for(end) - len(table.block_ids)
        self._reserve(new + int(cow))  # all-or-nothing: past this line nothing can run out
        if cow:
            self._copy_on_write(table, start // bs)
        if new:
            table.block_ids.extend(self.pool.allocate(new, table.seq_id))
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
        if table.block_ids:
            b = self.pool.blocks[table.block_ids[-1]]
            if b.state not in APPENDABLE or table.seq_id not in b.owners:
                raise InvariantViolation(
                    f"seq {table.seq_id}: append to a table whose last block {b.block_id} is "
                    f"{b.state.name} (owners {sorted(b.owners)})"
                )

    def _copy_on_write(self, table: BlockTable, logical_block: int) -> int:
        src = table.block_ids[logical_block]
        dst = self.pool.allocate(1, table.seq_id)[0]
        self._ops.append(CopyBlock(src, dst, table.seq_id, logical_block))
        self.pool.set_valid(dst, self.pool.blocks[src].valid_len)
        table.block_ids[logical_block] = dst
        self.pool.remove_owner(src, table.seq_id)
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
        for i in range(table.num_published, full):
            if not self._publish_one(table, chain, i):
                table.publish_blocked = True
                break
            table.num_published = i + 1
        self._debug()

    def _publish_one(self, table: BlockTable, chain: BlockKeyChain, i: int) -> bool:
        bid = table.block_ids[i]
        state = self.pool.blocks[bid].state
        if state not in READABLE:
            raise InvariantViolation(f"seq {table.seq_id}: publish of block {bid} in {state.name}")
        parent = None if i == 0 else self.index.by_block.get(table.block_ids[i - 1])
        if i > 0 and parent is None:
            return False
        result = self.index.publish(chain.keys[i], bid, i, parent, chain.namespace_digest)
        return result in (PublishResult.PUBLISHED, PublishResult.ALREADY)

    # --- release ---------------------------------------------------------------------------
    def free_table(self, table: BlockTable) -> None:
        # Tail first: the tail gets the oldest release tick, so it is evicted before its prefix.
        for bid in reversed(table.block_ids):
            self.pool.remove_owner(bid, table.seq_id)
        table.reset()
        if self.live_tables.get(table.seq_id) is table:
            del self.live_tables[table.seq_id]
        self._debug()

    def fork(self, table: BlockTable, child_seq_id: int) -> BlockTable:
        """A child sequence sharing every block of `table` (parallel sampling); writes CoW."""
        self.check_appendable(table)
        child = self.new_table(child_seq_id)
        for bid in table.block_ids:
            self.pool.add_owner(bid, child_seq_id)
        child.block_ids = list(table.block_ids)
        child.num_tokens = table.num_tokens
        child.namespace = table.namespace
        child.num_published = table.num_published
        child.publish_blocked = table.publish_blocked
        child.bump()
        self._debug()
        return child

    # --- snapshots -------------------------------------------------------------------------
    def snapshot(self, table: BlockTable) -> TableSnapshot:
        blocks = [self.pool.blocks[bid] for bid in table.block_ids]
        for i, b in enumerate(blocks):
            if b.state not in READABLE:
                raise InvariantViolation(
                    f"seq {table.seq_id}: snapshot reads block[{i}]={b.block_id} in {b.state.name}"
                )
        for b in blocks:
            self.pool.pin(b.block_id)
        self._next_snap_id += 1
        snap = TableSnapshot(
            snap_id=self._next_snap_id,
            seq_id=table.seq_id,
            epoch=table.epoch,
            num_tokens=table.num_tokens,
            entries=tuple(SnapshotEntry(b.block_id, b.generation, b.valid_len) for b in blocks),
            block_ids=tuple(table.block_ids),
        )
        self.inflight[snap.snap_id] = snap
        return snap

    def release_snapshot(self, snap: TableSnapshot) -> None:
        if self.inflight.pop(snap.snap_id, None) is None:
            raise InvariantViolation(f"snapshot {snap.snap_id} of seq {snap.seq_id} released twice")
        for bid in reversed(snap.block_ids):  # tail first, like free_table (LRU ticks)
            self.pool.unpin(bid)
        self._debug()

    def validate_snapshot(self, snap: TableSnapshot) -> None:
        """Every entry still names the same block incarnation, readable and owned by the seq."""
        if snap.snap_id not in self.inflight:
            raise InvariantViolation(f"snapshot {snap.snap_id} of seq {snap.seq_id} not in flight")
        for i, e in enumerate(snap.entries):
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
        holders but must be copied too). Follow with free_table, or cancel_evict on failure."""
        for bid in table.block_ids:
            if self.pool.blocks[bid].state is _S.PRIVATE_WRITABLE:
                self.pool.begin_evict(bid)
        table.bump()
        self._debug()
        return list(table.block_ids)

    def cancel_evict(self, table: BlockTable) -> None:
        for bid in table.block_ids:
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
        n = self.blocks_for(num_tokens)
        self._reserve(n)
        ids = self.pool.allocate(n, table.seq_id, _S.RESTORING)
        for j, bid in enumerate(ids):
            self.pool.set_valid(bid, min(self.block_size, num_tokens - j * self.block_size))
        table.block_ids.extend(ids)
        table.num_tokens += num_tokens
        table.bump()
        self.live_tables[table.seq_id] = table
        self._debug()
        return ids

    def finish_restore(self, table: BlockTable) -> None:
        for bid in table.block_ids:
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
        check_invariants(self.pool, tables, self.index, self.inflight.values())

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
