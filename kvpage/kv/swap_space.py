"""The swap space (R11): a bounded CPU store of whole sequences' KV blocks, with failure injection
for the resource tests (R21)."""

from __future__ import annotations

from kvpage.errors import SwapError
from kvpage.kv.storage import SavedKV


class SwapSpace:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0
        self._stored: dict[int, SavedKV] = {}  # seq_id -> its blocks (and their scales), on CPU
        self.fail_next_writes = 0  # failure injection (R21): the next N writes raise

    def can_store(self, num_blocks: int) -> bool:
        return self.used_blocks + num_blocks <= self.capacity_blocks

    def write(self, seq_id: int, blocks: SavedKV) -> None:
        n = blocks.num_blocks
        if self.fail_next_writes > 0:
            self.fail_next_writes -= 1
            raise SwapError(f"injected swap-write failure for seq {seq_id}")
        if not self.can_store(n):
            raise SwapError(f"swap space full: {self.used_blocks}+{n} > {self.capacity_blocks}")
        if seq_id in self._stored:
            raise SwapError(f"seq {seq_id} is already swapped out")
        self._stored[seq_id] = blocks
        self.used_blocks += n

    def take(self, seq_id: int) -> SavedKV:
        blocks = self._stored.pop(seq_id)
        self.used_blocks -= blocks.num_blocks
        return blocks

    def discard(self, seq_id: int) -> None:
        if seq_id in self._stored:
            self.take(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._stored
