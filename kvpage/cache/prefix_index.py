"""Namespaced radix prefix index over full blocks, with leaf-first LRU eviction.

Each entry is one full block keyed by its chained key (see key_chain); its parent is the entry of the
previous block of the same prefix, so entries form a tree rooted at each namespace digest. A lookup
walks a sequence's keys from block 0 and stops at the first miss: O(prompt blocks).

Lookups go through the fast key and are confirmed with the 32-byte digest; a fast-key hit with a
different digest is cache corruption: counted, audited, and treated as a miss.

Tree rule kept by the manager: a block is published only if its parent entry is the block at the
previous position of the same table. Every holder of a child then holds its parent, so a referenced
entry never hangs below an evictable one, every CACHED block can eventually be evicted, and evicting
only leaves (entries without children) is enough to evict parents after their children.

Evictable leaves sit in a heap ordered by the tick at which their ref_count fell to 0 (lazy
deletion: an entry is stale if the block was hit again since). Eviction removes the entry from the
index before the pool bumps the generation and puts the block on the free list.

Layer groups (kvpage.cache.groups): each group publishes under its own key (`group_key`: group 0's
is the chained key itself, group g's the chained key salted by g), so one index and one LRU serve
every group. A sliding-window group's entries have no parent: each is a leaf on its own.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from dataclasses import dataclass

from kvpage.cache.block_pool import BlockPool, BlockState
from kvpage.cache.key_chain import BlockKey, BlockKeyChain
from kvpage.cache.stats import CacheStats
from kvpage.errors import InvariantViolation, OutOfBlocks


@dataclass(frozen=True, slots=True)
class DigestMismatch:
    """A fast-key hit whose full digest differed: counted as corruption, not served."""

    namespace: bytes
    fast_key: int
    wanted_digest: bytes
    found_digest: bytes
    block_id: int
    depth: int  # logical block index of the lookup


@dataclass(slots=True, eq=False)
class IndexEntry:
    fast_key: int
    digest: bytes
    block_id: int
    generation: int  # the block's generation when published; must still match when served
    depth: int  # logical block index (0 = first block of the prompt)
    namespace: bytes
    parent: IndexEntry | None
    num_children: int = 0


class PublishResult:
    PUBLISHED = "published"
    ALREADY = "already"  # this very block already holds the key
    TAKEN = "taken"  # another block holds the same digest (computed concurrently)
    COLLISION = "collision"  # another digest holds the fast key


class PrefixIndex:
    def __init__(
        self,
        pool: BlockPool,
        stats: CacheStats | None = None,
        fast_key_bits: int = 64,
    ):
        self.pool = pool
        self.stats = stats if stats is not None else pool.stats
        self.mismatches: list[DigestMismatch] = []  # since the last take_corruptions()
        self.fast_key_bits = fast_key_bits
        self.entries: dict[int, IndexEntry] = {}  # fast key -> entry
        self.by_block: dict[int, IndexEntry] = {}
        self.disabled: set[bytes] = set()  # namespace digests with caching switched off
        self._heap: list[tuple[int, int]] = []  # (last_used tick, block id) of evictable leaves

    def __len__(self) -> int:
        return len(self.entries)

    def is_enabled(self, namespace: bytes) -> bool:
        return namespace not in self.disabled

    def set_enabled(self, namespace: bytes, enabled: bool) -> None:
        if enabled:
            self.disabled.discard(namespace)
        else:
            self.disabled.add(namespace)

    # --- lookup ----------------------------------------------------------------------------
    def group_key(self, key: BlockKey, group: int) -> BlockKey:
        """Layer group `group`'s key for the block the chained `key` names: the same prefix, a
        different page (its own fast key and a digest no other group's equals). Group 0's is
        `key` itself, so a model with one group keys its blocks by the chain alone."""
        if group == 0:
            return key
        mask = (1 << self.fast_key_bits) - 1
        return BlockKey((key.fast ^ _group_salt(group)) & mask, key.digest + bytes((group,)))

    def match(self, chain: BlockKeyChain, max_blocks: int, group: int = 0) -> list[IndexEntry]:
        """Longest run of published blocks for chain.keys[0:max_blocks], each confirmed (in
        layer group `group`)."""
        hits: list[IndexEntry] = []
        parent: IndexEntry | None = None
        for depth in range(min(max_blocks, len(chain.keys))):
            key = self.group_key(chain.keys[depth], group)
            entry = self.confirmed(key, chain.namespace_digest, depth)
            if entry is None:
                break
            if entry.parent is not parent:
                raise InvariantViolation(
                    f"index entry for block {entry.block_id} at depth {depth} hangs below "
                    f"the wrong parent"
                )
            hits.append(entry)
            parent = entry
        return hits

    def confirmed(self, key: BlockKey, namespace: bytes, depth: int) -> IndexEntry | None:
        """The joinable entry under `key`'s fast key, its full digest confirmed (a declared seam,
        kvpage.engine.hooks): a fast-key match alone is never served."""
        entry = self.entries.get(key.fast)
        if entry is None:
            return None
        if entry.digest != key.digest:
            self.stats.corruption_count += 1
            self.mismatches.append(
                DigestMismatch(namespace, key.fast, key.digest, entry.digest, entry.block_id, depth)
            )
            return None
        block = self.pool.blocks[entry.block_id]
        if block.generation != entry.generation or not block.published:
            raise InvariantViolation(
                f"index entry for block {entry.block_id} is stale: published at generation "
                f"{entry.generation}, block now at {block.generation} ({block.state.name})"
            )
        if block.state not in (BlockState.SHARED_READONLY, BlockState.CACHED):
            return None  # e.g. EVICTING: content fine, but not joinable now
        return entry

    def take_corruptions(self) -> list[DigestMismatch]:
        found, self.mismatches = self.mismatches, []
        return found

    # --- publish ---------------------------------------------------------------------------
    def publish(
        self, key: BlockKey, block_id: int, depth: int, parent: IndexEntry | None, namespace: bytes
    ) -> str:
        existing = self.entries.get(key.fast)
        if existing is not None:
            if existing.digest != key.digest:
                self.stats.key_collisions += 1
                return PublishResult.COLLISION
            if existing.block_id == block_id:
                return PublishResult.ALREADY
            return PublishResult.TAKEN
        if block_id in self.by_block:
            raise InvariantViolation(f"block {block_id} is already published under another key")
        self.pool.mark_published(block_id)
        entry = IndexEntry(
            key.fast,
            key.digest,
            block_id,
            self.pool.blocks[block_id].generation,
            depth,
            namespace,
            parent,
        )
        self.entries[key.fast] = entry
        self.by_block[block_id] = entry
        if parent is not None:
            parent.num_children += 1
        return PublishResult.PUBLISHED

    # --- eviction --------------------------------------------------------------------------
    def note_cached(self, block_id: int) -> None:
        """Pool callback: a published block's ref_count fell to 0."""
        if self.by_block[block_id].num_children == 0:
            self._push(block_id)

    def num_evictable(self) -> int:
        # Every CACHED block can be evicted, possibly after its (CACHED) children; see module doc.
        return self.pool.counts[BlockState.CACHED]

    def evict_one(self) -> int:
        """Evict the CACHED leaf `choose_victim` picks; returns its block id (now FREE)."""
        bid = self.choose_victim()
        self.remove(self.by_block[bid])
        self.pool.evict_cached(bid)
        return bid

    def choose_victim(self) -> int:
        """The least recently used CACHED leaf (the eviction policy, a declared seam of
        kvpage.engine.hooks). Stale heap entries (hit since) are dropped on the way."""
        while self._heap:
            tick, bid = heapq.heappop(self._heap)
            if self._is_evictable_leaf(bid, tick):
                return bid
        raise OutOfBlocks("no evictable cached block")

    def _is_evictable_leaf(self, block_id: int, tick: int) -> bool:
        b = self.pool.blocks[block_id]
        if b.state is not BlockState.CACHED or b.last_used != tick:
            return False  # stale heap entry: hit (and maybe released) since
        return self.by_block[block_id].num_children == 0

    def remove(self, entry: IndexEntry) -> None:
        """Take an entry out of the index; its parent may become an evictable leaf."""
        del self.entries[entry.fast_key]
        del self.by_block[entry.block_id]
        parent = entry.parent
        if parent is not None:
            parent.num_children -= 1
            pb = self.pool.blocks[parent.block_id]
            if parent.num_children == 0 and pb.state is BlockState.CACHED:
                self._push(parent.block_id)

    def _push(self, block_id: int) -> None:
        heapq.heappush(self._heap, (self.pool.blocks[block_id].last_used, block_id))
        if len(self._heap) > 2 * self.pool.counts[BlockState.CACHED] + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [(t, b) for t, b in self._heap if self._is_evictable_leaf(b, t)]
        heapq.heapify(self._heap)

    def evictable_leaves(self) -> list[int]:
        """Block ids in eviction order (for tests and the invariant checker); O(heap log heap)."""
        return [b for t, b in sorted(self._heap) if self._is_evictable_leaf(b, t)]


@functools.cache
def _group_salt(group: int) -> int:
    return int.from_bytes(hashlib.sha256(b"kvpage.group%d" % group).digest()[:8], "little")
