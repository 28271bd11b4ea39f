"""Rank 0's KV pool shard. Every whole-block operation is one command to all ranks, executed on
each rank's own KV heads of the same block ids; `ShardOps` is that execution, shared by rank 0
and the workers so both sides do exactly the same thing."""

from __future__ import annotations

import torch

from kvpage.distributed.commands import CopyBlock, Invalidate, ReadBlocks, WriteBlocks
from kvpage.distributed.group import TPGroup
from kvpage.model.paged_attention import KVStorage, SavedKV


class ShardOps:
    """A rank's side of the block commands over its pool shard (KV heads on dim 4)."""

    def __init__(self, storage: KVStorage, group: TPGroup, num_kv_heads: int) -> None:
        self.storage, self.group, self.kvh = storage, group, num_kv_heads

    def read(self, local: SavedKV) -> SavedKV | None:
        """Gather every rank's shard of the blocks; the whole SavedKV on rank 0."""
        data = self.group.gather(local.data)
        scales = None if local.scales is None else self.group.gather(local.scales)
        if data is None:
            return None
        return SavedKV(torch.cat(data, dim=4), None if scales is None else torch.cat(scales, dim=4))

    def own(self, blocks: SavedKV) -> SavedKV:
        """This rank's KV heads of a whole SavedKV."""
        heads = slice(self.group.rank * self.kvh, (self.group.rank + 1) * self.kvh)
        scales = None if blocks.scales is None else blocks.scales[:, :, :, :, heads].contiguous()
        return SavedKV(blocks.data[:, :, :, :, heads].contiguous(), scales)

    def ack(self) -> None:
        """Every rank's copy is done once this returns (an all-reduce over a flag)."""
        self.group.all_reduce(torch.ones(1))


class ShardedKVStorage(KVStorage):
    """KVStorage whose whole-block operations also run on every worker. `send` is rank 0's
    command channel (heartbeat check + broadcast). Writes of new tokens are not commands: each
    rank writes its own K/V inside the step's forward pass."""

    def __init__(self, *args, send, group: TPGroup, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.send = send
        self.ops = ShardOps(self, group, self.data.shape[4])

    def copy_block(self, src: int, dst: int) -> None:
        self.send(CopyBlock(src, dst))
        super().copy_block(src, dst)

    def invalidate(self, block_id: int) -> None:
        # Only a scaled layout keeps anything to invalidate; after a lost group, rank 0 still
        # frees the failed requests' blocks but no worker is left to tell.
        if self.scales is not None and self.ops.group.failed is None:
            self.send(Invalidate(block_id))
        super().invalidate(block_id)

    def read_blocks(self, block_ids: list[int]) -> SavedKV:
        self.send(ReadBlocks(list(block_ids)))
        return self.ops.read(super().read_blocks(block_ids))

    def write_blocks(self, block_ids: list[int], blocks: SavedKV) -> None:
        """Restore: returns only when every rank's copy is in its pool, so the caller's
        finish_restore (the table becoming readable) follows every rank's copy (R11)."""
        self.send(WriteBlocks(list(block_ids), blocks))
        super().write_blocks(block_ids, self.ops.own(blocks))
        self.ops.ack()
