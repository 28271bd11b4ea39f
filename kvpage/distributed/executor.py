"""Rank 0 of a tensor-parallel engine: starts the workers, holds the process group, its own
weight and KV shards, and the one command channel to the workers.

Start-up: rank 0 opens the rendezvous store on a free port, spawns ranks 1..N-1
(torch.multiprocessing, spawn) with the full weights in shared memory, and joins the gloo group
with them. Per step, rank 0 broadcasts one `Step` (token ids, positions and the attention
metadata: slot mapping, block tables, cu_seqlens); every rank runs its shard, the row-parallel
layers all-reduce, and rank 0 alone computes logits (the head is replicated).

Failure: before every command rank 0 checks that each worker process is alive (a heartbeat that
costs a waitpid); a worker that hangs trips the collective timeout. Either raises WorkerFailure,
after which the group is shut down and every worker is killed."""

from __future__ import annotations

import contextlib
import os
import time
import weakref

import torch
import torch.multiprocessing as mp

from kvpage.config import EngineConfig
from kvpage.distributed.commands import Command, Step, Stop
from kvpage.distributed.group import TPGroup, master_store
from kvpage.distributed.shard_model import build_shard
from kvpage.distributed.sharding import check_divisible
from kvpage.distributed.storage import ShardedKVStorage
from kvpage.distributed.worker import WorkerSpec, worker_main
from kvpage.engine.runner import ModelRunner
from kvpage.errors import WorkerFailure
from kvpage.model.base import CausalLM
from kvpage.model.kv_format import KVFormat
from kvpage.model.paged_attention import PagedAttentionMetadata

JOIN_TIMEOUT_S = 5.0
STARTUP_GRACE_S = 30.0  # a worker's interpreter and torch import, on top of the timeout


class TensorParallelExecutor:
    def __init__(
        self, config: EngineConfig, model: CausalLM, num_blocks: int, fmt: KVFormat
    ) -> None:
        self.world_size = config.tensor_parallel_size
        self.timeout_s = config.tensor_parallel_timeout_s
        check_divisible(model.config, self.world_size)  # before any process is started
        store = master_store(self.world_size, self.timeout_s)
        self.procs = self._spawn(config, model, num_blocks, store.port)
        # Kill the workers even if nobody calls shutdown (a test that forgot, interpreter exit).
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        try:
            self._await_workers(store)
            self.group = TPGroup(store, 0, self.world_size, self.timeout_s)
            self.model, plan = build_shard(model.config, model.state_dict(), self.group)
        except BaseException:
            self.shutdown()
            raise
        mcfg = model.config
        self.storage = ShardedKVStorage(
            mcfg.num_layers,
            num_blocks,
            config.block_size,
            plan.num_kv_heads,
            mcfg.head_dim,
            fmt,
            "cpu",
            send=self.send,
            group=self.group,
        )
        self.closed = False

    def _spawn(self, config: EngineConfig, model: CausalLM, num_blocks: int, port: int):
        ctx = mp.get_context("spawn")
        state = {k: v.detach() for k, v in model.state_dict().items()}
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        procs = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(
                rank,
                self.world_size,
                port,
                self.timeout_s,
                os.getpid(),
                model.config,
                state,
                num_blocks,
                config.block_size,
                config.kv_cache_dtype,
                threads,
            )
            proc = ctx.Process(
                target=worker_main, args=(spec,), daemon=True, name=f"kvpage-tp{rank}"
            )
            proc.start()
            procs.append(proc)
        return procs

    def _await_workers(self, store) -> None:
        """Wait until every worker has reached the store, watching that none died on the way
        (a bad import, or a script without `if __name__ == "__main__":`, which spawn re-runs)."""
        keys = [f"kvpage-ready-{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s + STARTUP_GRACE_S
        while not store.check(keys):
            dead = [p for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                what = f"exited with code {dead[0].exitcode}" if dead else "did not start in time"
                raise WorkerFailure(
                    f"tensor-parallel worker {what} during start-up (under spawn, a script "
                    'that starts an engine needs `if __name__ == "__main__":`)'
                )
            time.sleep(0.02)

    def runner(self, cache) -> TPModelRunner:
        return TPModelRunner(self.model, self.storage, cache, self.send)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, cmd: Command) -> None:
        """One command to every worker; the heartbeat first, so a dead worker is named at once
        instead of surfacing as a broken socket somewhere in the step."""
        if self.group.failed is not None:
            raise self.group.failed
        dead = [
            f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})"
            for i, p in enumerate(self.procs)
            if not p.is_alive()
        ]
        if dead:
            self.group.failed = WorkerFailure(
                f"tensor-parallel worker died: {', '.join(dead)}; the group is shut down"
            )
            raise self.group.failed
        self.group.send_object(cmd)

    def shutdown(self) -> None:
        """Stop the workers (politely if the group is healthy), then make sure they are gone."""
        group = getattr(self, "group", None)
        if group is not None and group.failed is None and not getattr(self, "closed", True):
            with contextlib.suppress(WorkerFailure):  # a worker lost now is killed below
                self.send(Stop())
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S if group is not None and group.failed is None else 0.1)
        _kill(self.procs)
        if group is not None:
            group.close()
        self.closed = True


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(JOIN_TIMEOUT_S)


class TPModelRunner(ModelRunner):
    """ModelRunner over rank 0's shard: the step's inputs go to every worker first."""

    def __init__(self, model: CausalLM, storage, cache, send) -> None:
        super().__init__(model, storage, cache)
        self.send = send

    def forward(self, ids_pos: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        self.send(Step(ids_pos, meta))
        return super().forward(ids_pos, meta)
