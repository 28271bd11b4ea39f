"""One manager per attention kind (vLLM's single-type managers): the rules of one layer group's
table (kvpage.cache.groups). A full-attention group keeps the whole prefix, finds its prefix hit
by walking the radix tree from block 0 and publishes each full block under its parent; a
sliding-window group keeps only the blocks its window reaches, finds each block of a hit on its
own and publishes flat (no parent: its table no longer holds the blocks before the window).

A group manager holds no table: the cache manager (kvpage.cache.manager) coordinates them over
every table's groups, each group's entries in `BlockTable.groups[group]`."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvpage.cache.block_pool import READABLE
from kvpage.cache.groups import NULL_BLOCK, KVLayout, first_needed_block
from kvpage.cache.key_chain import BlockKey, BlockKeyChain
from kvpage.cache.prefix_index import PrefixIndex, PublishResult
from kvpage.errors import InvariantViolation

PUBLISHED = (PublishResult.PUBLISHED, PublishResult.ALREADY)


class LayerGroupManager(ABC):
    window: int | None = None  # None: full attention (the whole prefix)

    def __init__(self, group: int, block_size: int, index: PrefixIndex):
        self.group = group
        self.block_size = block_size
        self.index = index

    def first_kept(self, start: int) -> int:
        """The first block a query at a position >= start can read."""
        return 0

    def key(self, chain: BlockKeyChain, depth: int) -> BlockKey:
        return self.index.group_key(chain.keys[depth], self.group)

    def lookup(self, chain: BlockKeyChain, depth: int) -> int | None:
        """The joinable block this group published for the chain's block `depth`."""
        entry = self.index.confirmed(self.key(chain, depth), chain.namespace_digest, depth)
        return None if entry is None else entry.block_id

    @abstractmethod
    def find_hits(self, chain: BlockKeyChain, max_blocks: int) -> list[int | None]:
        """The group's published blocks for the chain's blocks [0, max_blocks) (None: a miss)."""

    def serves(self, found: list[int | None], h: int) -> bool:
        """A hit of h blocks has every block this group's queries from h on read."""
        return len(found) >= h and None not in found[self.first_kept(h * self.block_size) : h]

    def taken(self, found: list[int | None], h: int) -> list[int]:
        """The group's table after a hit of h blocks: NULL_BLOCK where no query reads."""
        lo = self.first_kept(h * self.block_size)
        return [NULL_BLOCK] * lo + found[lo:h]

    @abstractmethod
    def publish(self, ids: list[int], chain: BlockKeyChain, i: int) -> bool:
        """Publish block i of the group's table `ids`; False when later blocks must not be."""


class FullAttentionManager(LayerGroupManager):
    def find_hits(self, chain: BlockKeyChain, max_blocks: int) -> list[int | None]:
        return [e.block_id for e in self.index.match(chain, max_blocks, self.group)]

    def publish(self, ids: list[int], chain: BlockKeyChain, i: int) -> bool:
        """Under its parent, the block before it in the same table (the radix rule)."""
        bid = ids[i]
        state = self.index.pool.blocks[bid].state
        if state not in READABLE:
            raise InvariantViolation(f"group {self.group}: publish of block {bid} in {state.name}")
        parent = None if i == 0 else self.index.by_block.get(ids[i - 1])
        if i > 0 and parent is None:
            return False
        result = self.index.publish(self.key(chain, i), bid, i, parent, chain.namespace_digest)
        return result in PUBLISHED


class SlidingWindowManager(LayerGroupManager):
    def __init__(self, group: int, block_size: int, index: PrefixIndex, window: int):
        super().__init__(group, block_size, index)
        self.window = window

    def first_kept(self, start: int) -> int:
        return first_needed_block(start, self.window, self.block_size)

    def find_hits(self, chain: BlockKeyChain, max_blocks: int) -> list[int | None]:
        return [self.lookup(chain, d) for d in range(max_blocks)]

    def publish(self, ids: list[int], chain: BlockKeyChain, i: int) -> bool:
        """Flat, while still held (a block already given back is skipped)."""
        bid = ids[i]
        if bid == NULL_BLOCK or self.index.pool.blocks[bid].state not in READABLE:
            return True
        result = self.index.publish(self.key(chain, i), bid, i, None, chain.namespace_digest)
        return result in PUBLISHED


def managers_for(
    layout: KVLayout | None, block_size: int, index: PrefixIndex
) -> tuple[LayerGroupManager, ...]:
    """One manager per layer group of `layout` (None: one full-attention group)."""
    windows = (None,) if layout is None else tuple(g.window for g in layout.groups)
    return tuple(
        FullAttentionManager(g, block_size, index)
        if w is None
        else SlidingWindowManager(g, block_size, index, w)
        for g, w in enumerate(windows)
    )
