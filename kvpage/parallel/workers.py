"""Ranks 1..N-1 as seen from rank 0: start-up, the command channel with its heartbeat, and
shutdown. One WorkerGroup holds one model's shards; engines configure its KV pool shards.

Start-up: rank 0 opens the rendezvous store on a port the OS picks, spawns the workers
(torch.multiprocessing, spawn) with the full weights in shared memory, waits until each has
reached the store (watching that none died on the way), then all join one gloo group and shard
the model.

Failure: before every command rank 0 checks that each worker process is alive (a heartbeat that
costs a waitpid); a worker that hangs trips the collective timeout. Either raises WorkerFailure;
the group is then unusable and shutdown kills what is left."""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp

from kvpage.errors import WorkerFailure
from kvpage.model.base import CausalLM
from kvpage.model.kernels import bound_with, kernel_choice
from kvpage.parallel.commands import Command, Stop
from kvpage.parallel.group import TPGroup, master_store
from kvpage.parallel.shard_model import build_shard
from kvpage.parallel.sharding import check_divisible
from kvpage.parallel.worker import WorkerSpec, worker_main

JOIN_TIMEOUT_S = 5.0
STARTUP_GRACE_S = 30.0  # a worker's interpreter and torch import, on top of the timeout


def core_share(world_size: int) -> int:
    """Intra-op threads per rank: the cores divided among the ranks, which compute at the same
    time. More threads than cores make OpenMP's barriers spin against the other ranks: on 2
    cores, rank 0 at 2 threads beside a 1-thread worker ran 3 gate cases' steps in 10.4 s, at
    1 thread in 3.1 s."""
    return max(1, (os.cpu_count() or 1) // world_size)


# Rank 0 keeps to its share while any worker group lives, and gets its own setting back after
# the last one. For the group's life, not per command: switching torch's thread count around
# every command measured slower (14 gate cases: 9.9 s switching, 6.8 s at the share).
_cores = {"groups": 0, "before": 0}


def _take_core_share(world_size: int) -> None:
    if _cores["groups"] == 0:
        _cores["before"] = torch.get_num_threads()
    _cores["groups"] += 1
    torch.set_num_threads(min(torch.get_num_threads(), core_share(world_size)))


def _give_back_cores() -> None:
    _cores["groups"] -= 1
    if _cores["groups"] == 0:
        torch.set_num_threads(_cores["before"])


class WorkerGroup:
    def __init__(self, model: CausalLM, world_size: int, timeout_s: float) -> None:
        check_divisible(model.config, world_size)  # before any process is started
        self.source, self.world_size, self.timeout_s = model, world_size, timeout_s
        # Every rank binds as the engine's model is bound (EngineConfig.fast_paths_off).
        self.kernels = bound_with(model) or kernel_choice()
        self.group: TPGroup | None = None
        self.closed = False
        self.lease: object | None = None  # the executor (engine) the workers now serve
        self.holds_cores = False
        store = master_store(world_size, timeout_s)
        self.procs = self._spawn(model, store.port)
        # Kill the workers even if nobody calls shutdown (a test that forgot, interpreter exit).
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        try:
            self._await_workers(store)
            self.group = TPGroup(store, 0, world_size, timeout_s)
            self.model, self.plan = build_shard(
                model.config, model.state_dict(), self.group, self.kernels
            )
            _take_core_share(world_size)
            self.holds_cores = True
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, model: CausalLM, port: int) -> list:
        ctx = mp.get_context("spawn")
        state = {k: v.detach() for k, v in model.state_dict().items()}
        threads = core_share(self.world_size)
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
                threads,
                self.kernels,
            )
            proc = ctx.Process(
                target=worker_main, args=(spec,), daemon=True, name=f"kvpage-tp{rank}"
            )
            proc.start()
            procs.append(proc)
        return procs

    def _await_workers(self, store) -> None:
        """Until every worker has reached the store; a worker that exits first (a bad import, or
        a script without `if __name__ == "__main__":`, which spawn re-runs) fails at once."""
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

    @property
    def healthy(self) -> bool:
        return not self.closed and self.group is not None and self.group.failed is None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, cmd: Command, deferred: Sequence[Command] = ()) -> None:
        """One command (after the `deferred` ones, in the same message) to every worker; the
        heartbeat first, so a dead worker is named at once instead of surfacing as a broken
        socket somewhere in the step."""
        if self.group.failed is not None:
            raise self.group.failed
        dead = [
            f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})"
            for i, p in enumerate(self.procs)
            if not p.is_alive()
        ]
        if dead:
            self.group.failed = WorkerFailure(f"tensor-parallel worker died: {', '.join(dead)}")
            raise self.group.failed
        self.group.send_object([*deferred, cmd])

    def abandon(self, reason: str) -> None:
        """The group is out of step (rank 0 failed in the middle of a command): fail it with
        `reason` and stop the workers now."""
        if self.group is not None and self.group.failed is None:
            self.group.failed = WorkerFailure(f"tensor-parallel group abandoned: {reason}")
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers (politely if the group is healthy), then make sure they are gone."""
        if self.healthy:
            with contextlib.suppress(WorkerFailure):  # a worker lost now is killed below
                self.send(Stop())
            for proc in self.procs:
                proc.join(JOIN_TIMEOUT_S)
        _kill(self.procs)
        if self.group is not None:
            self.group.close()
        if self.holds_cores:
            _give_back_cores()
            self.holds_cores = False
        self.closed = True


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(JOIN_TIMEOUT_S)
