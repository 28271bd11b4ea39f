"""In-flight snapshots: what one step reads of a table, every group's held blocks pinned until
the step is done (a pin keeps a block from being freed, never makes it shared: block_pool)."""

from __future__ import annotations

from kvpage.cache.block_pool import READABLE, BlockPool
from kvpage.cache.block_table import BlockTable, SnapshotEntry, TableSnapshot
from kvpage.errors import InvariantViolation


class Snapshots:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.inflight: dict[int, TableSnapshot] = {}
        self._next_id = 0

    def take(self, table: BlockTable) -> TableSnapshot:
        """The table as it is, its held blocks each checked readable and pinned."""
        held = [self._readable(table, g, ids) for g, ids in enumerate(table.groups)]
        pin = self.pool.pin
        for blocks in held:  # every block checked before any is pinned
            for b in blocks:
                pin(b.block_id)
        entries = [
            tuple([SnapshotEntry(b.block_id, b.generation, b.valid_len) for b in blocks])
            for blocks in held
        ]
        self._next_id += 1
        snap = TableSnapshot(
            snap_id=self._next_id,
            seq_id=table.seq_id,
            epoch=table.epoch,
            num_tokens=table.num_tokens,
            entries=entries[0],
            block_ids=tuple(table.groups[0]),
            extra_block_ids=tuple([tuple(ids) for ids in table.groups[1:]]),
            extra_entries=tuple(entries[1:]),
        )
        self.inflight[snap.snap_id] = snap
        return snap

    def _readable(self, table: BlockTable, group: int, ids: list[int]) -> list:
        blocks = self.pool.blocks
        held = (
            [blocks[b] for b in ids if b >= 0] if table.trimmed[group] else [blocks[b] for b in ids]
        )
        for i, b in enumerate(held):
            if b.state not in READABLE:
                raise InvariantViolation(
                    f"seq {table.seq_id}: snapshot reads group {group} block[{i}]={b.block_id} "
                    f"in {b.state.name}"
                )
        return held

    def release(self, snap: TableSnapshot) -> None:
        """Unpin every group's blocks, each group tail first (like free_table: LRU ticks)."""
        if self.inflight.pop(snap.snap_id, None) is None:
            raise InvariantViolation(f"snapshot {snap.snap_id} of seq {snap.seq_id} released twice")
        for entries in snap.group_entries():
            for e in reversed(entries):
                self.pool.unpin(e.block_id)

    def validate(self, snap: TableSnapshot) -> None:
        """Every entry still names the same block incarnation, readable and owned by the seq."""
        if snap.snap_id not in self.inflight:
            raise InvariantViolation(f"snapshot {snap.snap_id} of seq {snap.seq_id} not in flight")
        entries = [e for group in snap.group_entries() for e in group]
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
