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

Layer groups (kvpage.cache.groups, which explains the design): the manager is the coordinator of
one manager per group (kvpage.cache.group_managers: full attention or sliding window, vLLM's
shape). Every operation covers every group of a table alike; a model with one full-attention
group is the case of one group, not a separate path.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpage.cache.allocation import Allocation
from kvpage.cache.block_ops import BlockOp, InvalidateBlock
from kvpage.cache.block_pool import BlockPool, CacheUsage
from kvpage.cache.block_table import BlockTable, TableSnapshot
from kvpage.cache.group_managers import managers_for
from kvpage.cache.groups import NULL_BLOCK, KVLayout
from kvpage.cache.invariants import check_invariants
from kvpage.cache.key_chain import BlockKey, BlockKeyChain
from kvpage.cache.namespace import CacheNamespace
from kvpage.cache.prefix_index import DigestMismatch, PrefixIndex
from kvpage.cache.snapshots import Snapshots
from kvpage.cache.stats import CacheStats
from kvpage.cache.swap_support import SwapSupport
from kvpage.errors import InvariantViolation


class KVCacheManager(Allocation, SwapSupport):
    """The coordinator of the layer groups' managers: prefix hits, publishing, release, forks
    and snapshots here; room in kvpage.cache.allocation, swap in kvpage.cache.swap_support."""

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
        self.enable_prefix_caching = enable_prefix_caching
        self.fast_key_bits = fast_key_bits
        self.debug_checks = debug_checks
        self.stats = CacheStats()
        self.pool = BlockPool(num_blocks, block_size, self.stats)
        # A block's per-generation KV state (a quantized block's scales) dies with it: each free
        # becomes an InvalidateBlock for the KV store. A plain layout keeps none, so no op.
        if invalidate_freed:
            self.invalidate_on_free()
        self.index = PrefixIndex(self.pool, self.stats, fast_key_bits)
        self.pool.on_cached = self.index.note_cached
        self.managers = managers_for(layout, block_size, self.index)
        self.windows: tuple[int | None, ...] = tuple(m.window for m in self.managers)
        self.windowed = any(w is not None for w in self.windows)  # some group trims
        self._full = [m.group for m in self.managers if m.window is None]
        self._sliding = [m.group for m in self.managers if m.window is not None]
        self._ops: list[BlockOp] = []  # block operations since the last take_block_ops()
        self._corruptions: list[tuple[int, DigestMismatch]] = []  # (seq id, what it found)
        self.live_tables: dict[int, BlockTable] = {}  # seq_id -> table holding blocks
        self.snapshots = Snapshots(self.pool)
        self.inflight = self.snapshots.inflight

    def invalidate_on_free(self) -> None:
        """Every block freed from now on becomes an InvalidateBlock for the KV store, in order
        with the step's other block operations (a pending swap-out still reads it first)."""
        self.pool.on_free = lambda block_id: self._ops.append(InvalidateBlock(block_id))

    @property
    def extra_windows(self) -> tuple[int | None, ...]:
        """The windows of groups 1.. (a snapshot's `extra_block_ids`, the runner's extra
        attention metadata)."""
        return self.windows[1:]

    # --- construction ----------------------------------------------------------------------
    def new_table(self, seq_id: int) -> BlockTable:
        old = self.live_tables.get(seq_id)
        if old is not None and old.block_ids:
            raise InvariantViolation(f"seq {seq_id} already has a live table {old.block_ids}")
        table = BlockTable.of_groups(seq_id, len(self.managers))
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
        if table.num_tokens or any(table.groups):
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
        tables = self.hit_tables(chain, cap if max_blocks is None else min(cap, max_blocks))
        for found in self.index.take_corruptions():  # the index knows keys, not sequences
            self._corruptions.append((table.seq_id, found))
        for ids in tables:
            for bid in ids:
                if bid != NULL_BLOCK:
                    self.pool.add_owner(bid, table.seq_id)
        table.groups = tables
        table.trimmed = [next((i for i, b in enumerate(ids) if b >= 0), len(ids)) for ids in tables]
        h = len(tables[0])
        table.num_tokens = h * self.block_size
        table.num_published = h
        table.bump()
        self.live_tables[table.seq_id] = table
        self.stats.hit_tokens += table.num_tokens
        self._debug()
        return table.num_tokens

    def hit_tables(self, chain: BlockKeyChain, max_blocks: int) -> list[list[int]]:
        """The hybrid prefix-hit rule (a declared seam, kvpage.engine.hooks): the longest
        h <= max_blocks that every group serves (a full-attention group the whole prefix [0, h),
        a sliding-window group the blocks its window reads at h), and each group's table for it
        (NULL_BLOCK where a window needs none). Full-attention groups bound h first."""
        h = min(max_blocks, len(chain.keys))
        found: list[list[int | None]] = [[] for _ in self.managers]
        for g in self._full:
            found[g] = self.managers[g].find_hits(chain, h)
            h = len(found[g])
        for g in self._sliding:
            found[g] = self.managers[g].find_hits(chain, h)
        while h and not all(m.serves(found[m.group], h) for m in self.managers):
            h -= 1
        return [m.taken(found[m.group], h) for m in self.managers]

    def lookup_group(self, chain: BlockKeyChain, depth: int, group: int) -> int | None:
        """The joinable block layer group `group` published for the chain's block `depth`."""
        return self.managers[group].lookup(chain, depth)

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

    # --- publishing ------------------------------------------------------------------------
    def publish_full_blocks(self, table: BlockTable, chain: BlockKeyChain) -> None:
        """Publish the table's full blocks whose keys the chain knows, in every group. Call after
        the step that wrote their KV has finished: a published block can be read by any sequence
        at once."""
        self._check_chain(chain)
        if table.namespace is None:
            table.namespace = chain.namespace_digest
        elif table.namespace != chain.namespace_digest:
            raise InvariantViolation(f"seq {table.seq_id}: chain namespace differs from table's")
        if table.publish_blocked or not self._caching_on(chain.namespace_digest):
            return
        full = min(table.num_tokens // self.block_size, len(chain.keys))
        for i in range(table.num_published, full):
            if not all(m.publish(table.groups[m.group], chain, i) for m in self.managers):
                table.publish_blocked = True
                break
            table.num_published = i + 1
        self._debug()

    # --- release ---------------------------------------------------------------------------
    def free_table(self, table: BlockTable) -> None:
        """Full-attention groups first, tail first (the tail gets the oldest release tick, so it
        is evicted before its prefix); then the window groups, head first and position by
        position over them (like trim): their tails are what a hit of the whole prefix needs,
        so they are evicted last, and every window group's alike."""
        n, seq = len(table.block_ids), table.seq_id
        for j in reversed(range(n)):
            for g in self._full:
                self.pool.remove_owner(table.groups[g][j], seq)
        for j in range(n):
            for g in self._sliding:
                if table.groups[g][j] != NULL_BLOCK:
                    self.pool.remove_owner(table.groups[g][j], seq)
        table.reset()
        if self.live_tables.get(seq) is table:
            del self.live_tables[seq]
        self._debug()

    def fork(self, table: BlockTable, child_seq_id: int) -> BlockTable:
        """A child sequence sharing every block of `table` (parallel sampling); writes CoW."""
        self.check_appendable(table)
        child = self.new_table(child_seq_id)
        for bid in table.held_ids():
            self.pool.add_owner(bid, child_seq_id)
        child.groups = [list(ids) for ids in table.groups]
        child.trimmed = list(table.trimmed)
        child.num_tokens = table.num_tokens
        child.namespace = table.namespace
        child.num_published = table.num_published
        child.publish_blocked = table.publish_blocked
        child.bump()
        self._debug()
        return child

    # --- snapshots (kvpage.cache.snapshots) ------------------------------------------------
    def snapshot(self, table: BlockTable) -> TableSnapshot:
        return self.snapshots.take(table)

    def release_snapshot(self, snap: TableSnapshot) -> None:
        self.snapshots.release(snap)
        self._debug()

    def validate_snapshot(self, snap: TableSnapshot) -> None:
        """Every entry still names the same block incarnation, readable and owned by the seq."""
        self.snapshots.validate(snap)

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
        check_invariants(self.pool, tables, self.index, self.inflight.values(), self.windows)

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
