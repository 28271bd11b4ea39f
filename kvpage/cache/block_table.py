"""Per-sequence block table with an epoch, and the immutable snapshot one step reads.

Logical block `pos // block_size` of a sequence lives in physical block `ids[pos // block_size]`
at offset `pos % block_size`, where `ids` is one layer group's table (`groups[g]`, kvpage.cache.groups);
every group's table has `ceil(num_tokens / block_size)` entries. A sliding-window group's entries
that fell out of its window are NULL_BLOCK, all of them below its cursor `trimmed[g]` (0 for a
full-attention group: no NULL at all). `block_ids` is group 0's table, the whole table of a model
with one group. The epoch is bumped on every change, so a snapshot names exactly the table version
a step read. Only the manager mutates a table; everyone else reads it.
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
    groups: list[list[int]] = field(default_factory=lambda: [[]])  # one table per layer group
    trimmed: list[int] = field(default_factory=lambda: [0])  # per group: entries below are NULL
    num_tokens: int = 0  # tokens whose KV slots have been assigned
    epoch: int = 0
    namespace: bytes | None = None  # digest of the namespace its prefix blocks were keyed in
    num_published: int = 0  # leading blocks known to be in the prefix index (publish cursor)
    publish_blocked: bool = False  # a block could not be published; later ones cannot chain to it

    @classmethod
    def of_groups(cls, seq_id: int, num_groups: int) -> BlockTable:
        return cls(seq_id, [[] for _ in range(num_groups)], [0] * num_groups)

    @property
    def block_ids(self) -> list[int]:
        """Group 0's table: what events, traces and prefix-hit reports name."""
        return self.groups[0]

    def bump(self) -> None:
        self.epoch += 1

    def reset(self) -> None:
        self.groups = [[] for _ in self.groups]
        self.trimmed = [0] * len(self.groups)
        self.num_tokens = 0
        self.namespace = None
        self.num_published = 0
        self.publish_blocked = False
        self.epoch += 1

    def _untrimmed_single(self) -> bool:
        return len(self.groups) == 1 and not self.trimmed[0]

    def num_held(self) -> int:
        """Blocks the table holds over every group."""
        if self._untrimmed_single():
            return len(self.groups[0])
        return sum(b >= 0 for ids in self.groups for b in ids)

    def held_ids(self) -> list[int]:
        """Every block the table holds, group by group, each in logical order."""
        if self._untrimmed_single():
            return list(self.groups[0])
        return [b for ids in self.groups for b in ids if b >= 0]


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
    entries: tuple[SnapshotEntry, ...]  # group 0's held blocks, in table order
    block_ids: tuple[int, ...]  # group 0's table as read, NULL entries included
    # Groups 1.. (kvpage.cache.groups), the same two views each.
    extra_block_ids: tuple[tuple[int, ...], ...] = ()
    extra_entries: tuple[tuple[SnapshotEntry, ...], ...] = ()

    def group_entries(self) -> tuple[tuple[SnapshotEntry, ...], ...]:
        """Every group's held entries, group 0 first."""
        return (self.entries, *self.extra_entries)
