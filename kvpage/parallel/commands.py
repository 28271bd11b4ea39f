"""What rank 0 tells the workers, one pickled object per command, in order. Every rank executes
the same command on its own shard: a step's forward pass, or a block operation (CoW copy, swap
read/write, invalidation) on the same block ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpage.kv.storage import KVShard, SavedKV
from kvpage.lora.apply import SlotRows
from kvpage.lora.tables import Factors
from kvpage.model.paged_attention import PagedAttentionMetadata


@dataclass(slots=True)
class Configure:
    """A new engine takes the workers: a fresh, zeroed KV pool shard of this shape."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    rows: int = 0  # layers per pool page (kvpage.cache.groups); 0: every layer
    max_loras: int = 0  # > 0: the engine serves LoRA adapters, in tables of this many slots
    max_lora_rank: int = 0


@dataclass(slots=True)
class WriteLoraSlot:
    """An adapter became resident in `slot`: every rank writes its shard of the full factors."""

    slot: int
    factors: Factors


@dataclass(slots=True)
class Step:
    ids_pos: torch.Tensor  # (2, N) long: token ids and positions
    meta: PagedAttentionMetadata  # the same view of the pool for every rank
    lora_rows: SlotRows | None = None  # the adapter slots the step's rows use (None: base only)


@dataclass(slots=True)
class CopyBlock:
    src: int
    dst: int


@dataclass(slots=True)
class Invalidate:
    block_id: int


@dataclass(slots=True)
class ReadBlocks:
    block_ids: list[int]  # every rank sends its shard of these blocks to rank 0 (a gather)


@dataclass(slots=True)
class WriteBlocks:
    block_ids: list[int]
    blocks: SavedKV  # all ranks' shards, concatenated along KV heads in rank order


@dataclass(slots=True)
class ReadScales:
    block_ids: list[int]  # every rank sends its shard of these blocks' scales to rank 0


@dataclass(slots=True)
class PatchKV:
    """Apply `patch` to the rank's current KV pool shard (until the next Configure). Pickled by
    reference: a module-level function, so the name travels and each rank imports the code."""

    name: str
    patch: Callable[[KVShard], None]


@dataclass(slots=True)
class Stop:
    pass


Command = (
    Configure
    | Step
    | CopyBlock
    | Invalidate
    | ReadBlocks
    | WriteBlocks
    | ReadScales
    | PatchKV
    | WriteLoraSlot
    | Stop
)
