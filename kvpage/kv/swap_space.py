"""The swap space: a bounded CPU store of whole sequences' KV blocks.

Space is reserved when the scheduler plans a swap-out (so admission and the plan can count on it)
and filled when the executor copies the blocks; a copy that fails gives its reservation back."""

from __future__ import annotations

from kvpage.errors import SwapError
from kvpage.kv.storage import SavedKV


class SwapSpace:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0  # reserved or stored
        self._reserved: dict[int, int] = {}  # seq_id -> blocks planned, not yet copied
        self._stored: dict[int, SavedKV] = {}  # seq_id -> its blocks (and their scales), on CPU

    def can_store(self, num_blocks: int) -> bool:
        return self.used_blocks + num_blocks <= self.capacity_blocks

    def reserve(self, seq_id: int, num_blocks: int) -> None:
        if not self.can_store(num_blocks):
            raise SwapError(
                f"swap space full: {self.used_blocks}+{num_blocks} > {self.capacity_blocks}"
            )
        if seq_id in self:
            raise SwapError(f"seq {seq_id} is already swapped out")
        self._reserved[seq_id] = num_blocks
        self.used_blocks += num_blocks

    def store(self, seq_id: int, blocks: SavedKV) -> None:
        """The copy of a reserved swap-out; on failure the reservation stays for `cancel`."""
        planned = self._reserved.get(seq_id)
        if planned is None:
            raise SwapError(f"seq {seq_id} has no swap space reserved")
        if blocks.num_blocks != planned:
            raise SwapError(f"seq {seq_id}: {blocks.num_blocks} blocks, {planned} reserved")
        del self._reserved[seq_id]
        self._stored[seq_id] = blocks

    def cancel(self, seq_id: int) -> None:
        """A reserved swap-out that will not happen (its copy failed)."""
        self.used_blocks -= self._reserved.pop(seq_id)

    def take(self, seq_id: int) -> SavedKV:
        blocks = self._stored.pop(seq_id)
        self.used_blocks -= blocks.num_blocks
        return blocks

    def discard(self, seq_id: int) -> None:
        """A finished sequence's reservation or saved KV, if any, is dropped."""
        if seq_id in self._reserved:
            self.cancel(seq_id)
        elif seq_id in self._stored:
            self.take(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._stored or seq_id in self._reserved
