"""Ranks 1..N-1: a process started by rank 0 that holds its weight shard and KV pool shard and
executes rank 0's commands until told to stop, or until rank 0 goes away."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from kvpage.config import ModelConfig
from kvpage.errors import WorkerFailure
from kvpage.host_memory import keep_freed_memory
from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVStorage
from kvpage.lora.apply import LoraContext
from kvpage.lora.tables import SlotTables
from kvpage.model.kernels import KernelChoice
from kvpage.model.paged_attention import paged_backend
from kvpage.parallel.commands import (
    Configure,
    CopyBlock,
    Invalidate,
    PatchKV,
    ReadBlocks,
    ReadScales,
    Step,
    Stop,
    WriteBlocks,
    WriteLoraSlot,
)
from kvpage.parallel.group import TPGroup, worker_store
from kvpage.parallel.shard_model import build_shard
from kvpage.parallel.sharding import ShardPlan, attach_lora, shard_lora_factors
from kvpage.parallel.storage import ShardOps, shard_view


@dataclass(slots=True)
class WorkerSpec:
    rank: int
    world_size: int
    port: int
    timeout_s: float
    parent_pid: int
    model_config: ModelConfig
    state: dict[str, torch.Tensor]  # the full model's weights (shared memory under spawn)
    num_threads: int
    kernels: KernelChoice  # rank 0's: every rank runs the same kernels


def worker_main(spec: WorkerSpec) -> None:
    _exit_with_parent(spec.parent_pid)
    os.environ.update(torchrun_env(spec))
    torch.set_num_threads(spec.num_threads)
    keep_freed_memory()
    store = worker_store(spec.port, spec.world_size, spec.timeout_s)
    store.set(f"kvpage-ready-{spec.rank}", "1")
    try:
        group = TPGroup(store, spec.rank, spec.world_size, spec.timeout_s)
        model, plan = build_shard(spec.model_config, spec.state, group, spec.kernels)
        del spec.state
        _serve(Shard(group, model, plan))
    except WorkerFailure:
        os._exit(1)  # rank 0 is gone or broke the group: nothing left to serve


def torchrun_env(spec: WorkerSpec) -> dict[str, str]:
    """The variables torchrun gives each rank, so that code in a worker that reads them (a
    library's rank check, a logger) sees the group it is in. The group itself does not use them:
    it rendezvouses through rank 0's private store."""
    return {
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec.port),
    }


class Shard:
    """This rank's weights and, once an engine has configured it, its KV pool shard."""

    def __init__(self, group: TPGroup, model, plan: ShardPlan) -> None:
        self.group, self.model, self.plan = group, model, plan
        self.storage: KVStorage | None = None
        self.ops: ShardOps | None = None
        self.lora: LoraContext | None = None  # set when the configuring engine serves adapters

    def configure(self, cmd: Configure) -> None:
        cfg = self.model.config
        fmt = kv_format(cmd.kv_cache_dtype, self.model.dtype)
        self.storage = None  # the previous engine's pool goes before the new one is allocated
        self.storage = KVStorage(
            cmd.rows or cfg.num_layers,
            cmd.num_blocks,
            cmd.block_size,
            self.plan.num_kv_heads,
            cfg.head_dim,
            fmt,
            "cpu",
        )
        self.ops = ShardOps(self.storage, self.group, self.plan.num_kv_heads)
        self.lora = None
        if cmd.max_loras:
            tables = SlotTables(cmd.max_loras, cmd.max_lora_rank, self.model.dtype, "cpu")
            self.lora = attach_lora(self.model, tables)

    def execute(self, cmd) -> None:
        storage, ops = self.storage, self.ops
        if isinstance(cmd, Configure):
            self.configure(cmd)
        elif isinstance(cmd, Step):
            self.step(cmd)
        elif isinstance(cmd, CopyBlock):
            storage.copy_block(cmd.src, cmd.dst)
        elif isinstance(cmd, Invalidate):
            storage.invalidate(cmd.block_id)
        elif isinstance(cmd, ReadBlocks):
            ops.read(storage.read_blocks(cmd.block_ids))
        elif isinstance(cmd, WriteBlocks):
            storage.write_blocks(cmd.block_ids, ops.own(cmd.blocks))
            ops.ack()
        elif isinstance(cmd, ReadScales):
            ops.read_scales(cmd.block_ids)
        elif isinstance(cmd, PatchKV):
            cmd.patch(shard_view(storage, self.group))
        elif isinstance(cmd, WriteLoraSlot):
            self.lora.tables.write(cmd.slot, shard_lora_factors(cmd.factors, self.plan))

    def step(self, cmd: Step) -> None:
        if self.lora is not None:
            self.lora.use_rows(cmd.lora_rows, cmd.ids_pos.shape[1])
        try:
            self.model(cmd.ids_pos[0], cmd.ids_pos[1], paged_backend(self.storage, cmd.meta))
        finally:
            if self.lora is not None:
                self.lora.use_rows(None)


@torch.inference_mode()
def _serve(shard: Shard) -> None:
    while True:
        for cmd in shard.group.recv_object():  # a message: deferred commands, then one more
            if isinstance(cmd, Stop):
                return
            shard.execute(cmd)


def _exit_with_parent(parent_pid: int) -> None:
    """No orphans: if rank 0 dies without a word (SIGKILL), its sockets close and the next
    collective fails; this watchdog also covers a worker that is waiting in no collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kvpage-tp-parent-watch").start()
