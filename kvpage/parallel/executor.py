"""Rank 0 of a tensor-parallel engine: a WorkerGroup (new, or a shared one, see
`shared_workers`), rank 0's KV pool shard (whose block operations go to every rank), and the
forward pass that sends each step's inputs to the workers first (the engine's runner calls it).

Per step, rank 0 broadcasts one `Step` (token ids, positions and the attention metadata: slot
mapping, block tables, cu_seqlens); every rank runs its shard, the row-parallel layers
all-reduce, and rank 0 alone computes logits (the head is replicated)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from kvpage.cache.groups import kv_layout
from kvpage.config import EngineConfig
from kvpage.errors import WorkerFailure
from kvpage.kv.format import KVFormat
from kvpage.kv.storage import KVShard, KVStorage
from kvpage.lora.apply import LoraContext
from kvpage.lora.tables import Factors, SlotTables
from kvpage.model.base import CausalLM
from kvpage.model.kernels import bound_with
from kvpage.model.paged_attention import PagedAttentionMetadata
from kvpage.parallel.commands import Command, Configure, PatchKV, Step, WriteLoraSlot
from kvpage.parallel.sharding import attach_lora, shard_lora_factors
from kvpage.parallel.storage import ShardedKVStorage, shard_view
from kvpage.parallel.workers import WorkerGroup

T = TypeVar("T")

# Worker groups kept across engines inside `shared_workers()`: (id(model), N, timeout) -> group.
_shared: dict[tuple, WorkerGroup] | None = None


@contextlib.contextmanager
def shared_workers() -> Iterator[None]:
    """Engines made inside reuse one worker group per model (the verifier builds an engine per
    case and per mutant: a process start each would dominate); all are stopped on exit."""
    global _shared
    outer, _shared = _shared, {} if _shared is None else _shared
    try:
        yield
    finally:
        if outer is None:
            for group in _shared.values():
                group.shutdown()
        _shared = outer


def _group_for(model: CausalLM, world_size: int, timeout_s: float) -> tuple[WorkerGroup, bool]:
    """(group, shared?): a shared group of this very model when one is healthy, else a new one."""
    if _shared is None:
        return WorkerGroup(model, world_size, timeout_s), False
    key = (id(model), world_size, timeout_s)
    group = _shared.get(key)
    stale = group is not None and group.kernels != bound_with(model)  # ranks bind as it is
    if group is None or stale or not group.healthy or group.source is not model:
        if group is not None:
            group.shutdown()
        group = _shared[key] = WorkerGroup(model, world_size, timeout_s)
    return group, True


class TensorParallelExecutor:
    def __init__(
        self, config: EngineConfig, model: CausalLM, num_blocks: int, fmt: KVFormat
    ) -> None:
        mcfg = model.config
        rows = kv_layout(mcfg.num_layers, mcfg.layer_windows, config.kv_layer_groups).rows
        self.workers, self.shared = _group_for(
            model, config.tensor_parallel_size, config.tensor_parallel_timeout_s
        )
        self.lease = object()  # the group serves the engine that configured it last
        self.deferred: list[Command] = []
        self.workers.lease = self.lease
        try:
            self.send(
                Configure(
                    num_blocks,
                    config.block_size,
                    config.kv_cache_dtype,
                    rows,
                    max_loras=config.max_loras if config.enable_lora else 0,
                    max_lora_rank=config.max_lora_rank,
                )
            )
        except WorkerFailure:
            self.workers.shutdown()  # failed: not worth keeping, shared or not
            raise
        shard = KVStorage(
            rows,
            num_blocks,
            config.block_size,
            self.workers.plan.num_kv_heads,
            mcfg.head_dim,
            fmt,
            "cpu",
        )
        self.storage = ShardedKVStorage(
            shard, command=self.command, defer=self.defer, group=self.workers.group
        )
        self.lora: LoraContext | None = None  # rank 0's, when the engine serves adapters

    def serve_lora(self, tables: SlotTables) -> LoraContext:
        """Rank 0's model shard computes adapters from `tables`; the workers made theirs at
        Configure and hear of every slot written (`write_lora_slot`)."""
        self.lora = attach_lora(self.workers.model, tables)
        return self.lora

    def shard_lora_factors(self, factors: Factors) -> Factors:
        return shard_lora_factors(factors, self.workers.plan)

    def write_lora_slot(self, slot: int, factors: Factors) -> None:
        """Sent with the next command: a slot is written at admission, before the step that
        first reads it."""
        self.defer(WriteLoraSlot(slot, factors))

    @property
    def model(self) -> CausalLM:
        """Rank 0's shard of the model (its head replicated): what the engine's runner runs."""
        return self.workers.model

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    def send(self, cmd: Command) -> None:
        if self.workers.lease is not self.lease:
            raise WorkerFailure("this engine's tensor-parallel workers now serve a newer engine")
        deferred, self.deferred = self.deferred, []
        self.workers.send(cmd, deferred)

    def defer(self, cmd: Command) -> None:
        """`cmd` goes to the workers with the next command, in the same message: for one that
        only has to be done before the workers' next use of the pool (an invalidation), so a
        burst of frees costs no collective of its own."""
        self.deferred.append(cmd)

    def command(self, cmd: Command, local: Callable[[], T]) -> T:
        """`cmd` to every worker, then rank 0's own part of it. Should rank 0's part raise, the
        workers are left inside the command (waiting in an all-reduce or gather that rank 0
        never joins, or with a shard rank 0 did not change): the group is out of step for good,
        so it fails now, and a shared group is replaced by the next engine, instead of every
        later command waiting out the collective timeout first."""
        self.send(cmd)
        try:
            return local()
        except WorkerFailure:
            raise
        except BaseException as err:
            self.workers.abandon(
                f"rank 0 raised {type(err).__name__} in its part of {type(cmd).__name__}: {err}"
            )
            raise

    def forward_on_every_rank(
        self, ids_pos: torch.Tensor, meta: PagedAttentionMetadata, local: Callable[[], T]
    ) -> T:
        """The step's inputs to every worker, then rank 0's own forward pass over its shard."""
        step = self.lora.batch if self.lora is not None else None
        rows = None if step is None else step.slot_rows
        return self.command(Step(ids_pos, meta, rows), local)

    def patch_kv_shards(self, name: str, patch: Callable[[KVShard], None]) -> None:
        """`patch` on rank 0's shard first (a missing seam fails here, loudly, before any
        worker hears of it), then on every worker's: the same code on every rank's KV heads."""
        patch(shard_view(self.storage.shard, self.workers.group))
        self.send(PatchKV(name, patch))

    def shutdown(self) -> None:
        """Stop the workers; a shared group stays up for the next engine unless it failed."""
        if not self.shared or not self.workers.healthy:
            self.workers.shutdown()
