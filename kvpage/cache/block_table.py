"""Per-sequence block table with an epoch, and the immutable snapshot one step reads.

Logical block `pos // block_size` of a sequence lives in physical block `block_ids[pos // block_size]`
at offset `pos % block_size`. `len(block_ids) == ceil(num_tokens / block_size)` always holds.
The epoch is bumped on every change, so a snapshot names exactly the table version a step read.
Only the manager mutates a table; everyone else reads it.

With per-layer-group KV (kvpage.cache.groups) `block_ids` is group 0's table (a global group) and
`extra` holds groups 1.., the same length, a window group's given-back entries NULL_BLOCK.
An all-windowed model's group 0 is a window group: block_ids then has NULL_BLOCK entries too,
all below `trimmed0` (0 for a global group 0, so `trimmed0 == 0` means no NULL in block_ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens from position 0 (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True, eq=False)
class BlockTable:
    seq_id: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose KV slots have been assigned
    epoch: int = 0
    namespace: bytes | None = None  # digest of the namespace its prefix blocks were keyed in
    num_published: int = 0  # leading blocks known to be in the prefix index (publish cursor)
    publish_blocked: bool = False  # a block could not be published; later ones cannot chain to it
    extra: list[list[int]] = field(default_factory=list)  # groups 1..; empty with one group
    trimmed: list[int] = field(default_factory=list)  # per extra group: entries below are NULL
    trimmed0: int = 0  # the same for group 0 (only a window group 0 moves it)

    def bump(self) -> None:
        self.epoch += 1

    def reset(self) -> None:
        self.block_ids = []
        self.num_tokens = 0
        self.namespace = None
        self.num_published = 0
        self.publish_blocked = False
        self.trimmed0 = 0
        if self.extra:
            self.extra = [[] for _ in self.extra]
            self.trimmed = [0] * len(self.extra)
        self.epoch += 1

    def num_held(self) -> int:
        """Blocks the table holds over every group."""
        if not self.extra and not self.trimmed0:
            return len(self.block_ids)
        return sum(b >= 0 for ids in (self.block_ids, *self.extra) for b in ids)

    def held_ids(self) -> list[int]:
        """Every block the table holds, every group (group 0 first, then each extra group's)."""
        if not self.extra and not self.trimmed0:
            return list(self.block_ids)
        return [b for ids in (self.block_ids, *self.extra) for b in ids if b >= 0]


class SnapshotEntry(NamedTuple):
    block_id: int
    generation: int
    valid_len: int


@dataclass(frozen=True, slots=True)
class TableSnapshot:
    """What one step reads. Its blocks are pinned in the pool until the snapshot is released."""

    snap_id: int
    seq_id: int
    epoch: int
    num_tokens: int
    entries: tuple[SnapshotEntry, ...]
    block_ids: tuple[int, ...]
    # Groups 1.. (kvpage.cache.groups): their tables as read, NULL entries included, and the
    # entries of the blocks held (pinned), in table order.
    extra_block_ids: tuple[tuple[int, ...], ...] = ()
    extra_entries: tuple[tuple[SnapshotEntry, ...], ...] = ()
