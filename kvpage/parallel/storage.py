"""Rank 0's handle on the tensor-parallel KV pool. Every whole-block operation is one command to
all ranks, executed on each rank's own KV heads of the same block ids; `ShardOps` is that
execution, shared by rank 0 and the workers so both sides do exactly the same thing.

Rank 0's own shard is a plain `KVStorage` held by composition (`ShardedKVStorage.shard`), not
a subclass: what runs on a shard (its forward-pass writes and reads, its copy, swap and
invalidate) is the same object type on every rank, so a patch of a shard's method
(`LLMEngine.patch_kv_shards`) replaces the shard's work on every rank while the commands that
reach the other ranks still go out."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvpage.kv.format import KVFormat
from kvpage.kv.storage import KVShard, KVStorage, SavedKV
from kvpage.parallel.commands import CopyBlock, Invalidate, ReadBlocks, ReadScales, WriteBlocks
from kvpage.parallel.group import TPGroup


def shard_view(storage: KVStorage, group: TPGroup) -> KVShard:
    """A rank's KV shard as a `patch_kv_shards` patch sees it."""
    return KVShard(
        storage,
        group.rank,
        group.world_size,
        lambda t: group.all_reduce(t, dist.ReduceOp.MAX),
    )


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

    def read_scales(self, block_ids: list[int]) -> torch.Tensor | None:
        """Gather every rank's scales of the blocks, (L, 2, n, B, KVH) on rank 0 (the tracer's
        digests cover every KV head, not only rank 0's)."""
        parts = self.group.gather(self.storage.block_scales(block_ids))
        return None if parts is None else torch.cat(parts, dim=4)

    def own(self, blocks: SavedKV) -> SavedKV:
        """This rank's KV heads of a whole SavedKV."""
        heads = slice(self.group.rank * self.kvh, (self.group.rank + 1) * self.kvh)
        scales = None if blocks.scales is None else blocks.scales[:, :, :, :, heads].contiguous()
        return SavedKV(blocks.data[:, :, :, :, heads].contiguous(), scales)

    def ack(self) -> None:
        """Every rank's copy is done once this returns (an all-reduce over a flag)."""
        self.group.all_reduce(torch.ones(1))


class ShardedKVStorage:
    """What the engine holds as its KV storage: rank 0's `shard` plus the command channel.
    Whole-block operations run on every rank; writes of new tokens are not commands: each rank
    writes its own K/V inside the step's forward pass (rank 0's runner uses `shard`).
    `command(cmd, local)` is rank 0's channel (TensorParallelExecutor.command): `cmd` to every
    worker, then `local`, rank 0's part; `defer(cmd)` sends `cmd` with the next command."""

    def __init__(self, shard: KVStorage, *, command, defer, group: TPGroup) -> None:
        self.shard, self.command, self.defer = shard, command, defer
        self.ops = ShardOps(shard, group, shard.data.shape[4])

    @property
    def block_size(self) -> int:
        return self.shard.block_size

    @property
    def format(self) -> KVFormat:
        return self.shard.format

    @property
    def scales(self) -> torch.Tensor | None:
        """Rank 0's scales only (its KV heads); `block_scales` gathers every rank's."""
        return self.shard.scales

    @property
    def nbytes(self) -> int:
        return self.shard.nbytes

    def check_written(self, block_ids: tuple[int, ...], num_tokens: int, who: str = "") -> None:
        self.shard.check_written(block_ids, num_tokens, who)

    def block_scales(self, block_ids: list[int]) -> torch.Tensor | None:
        if self.shard.scales is None:
            return None
        return self.command(ReadScales(list(block_ids)), lambda: self.ops.read_scales(block_ids))

    def copy_block(self, src: int, dst: int) -> None:
        # A copy-on-write is applied before the step that writes after it, whose inputs are the
        # next command: the workers' part rides with it (a step is then one broadcast).
        if self.ops.group.failed is None:
            self.defer(CopyBlock(src, dst))
        self.shard.copy_block(src, dst)

    def invalidate(self, block_id: int) -> None:
        # Only a scaled layout keeps anything to invalidate; after a lost group, rank 0 still
        # frees the failed requests' blocks but no worker is left to tell. The workers' part
        # rides with the next command: no worker touches the pool before that.
        if self.shard.scales is not None and self.ops.group.failed is None:
            self.defer(Invalidate(block_id))
        self.shard.invalidate(block_id)

    def read_blocks(self, block_ids: list[int]) -> SavedKV:
        def local() -> SavedKV:
            return self.ops.read(self.shard.read_blocks(block_ids))

        return self.command(ReadBlocks(list(block_ids)), local)

    def write_blocks(self, block_ids: list[int], blocks: SavedKV) -> None:
        """Restore: returns only when every rank's copy is in its pool, so the caller's
        finish_restore (the table becoming readable) follows every rank's copy."""

        def local() -> None:
            self.shard.write_blocks(block_ids, self.ops.own(blocks))
            self.ops.ack()

        self.command(WriteBlocks(list(block_ids), blocks), local)
