"""The tensor-parallel process group: gloo over a TCP store, held as an object (not torch's
global default group), so several engines can live in one process and a test can tear one down.

Every collective here turns a gloo error or timeout into `WorkerFailure`: a dead peer closes its
sockets (gloo fails at once), a hung one trips the timeout."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpage.errors import WorkerFailure

# A command's first broadcast: its length and up to FRAME_BYTES - 8 pickled bytes (a step of a
# small batch pickles to ~3 KB), so most commands cost one collective, not two.
FRAME_BYTES = 16384

# How long an idle worker waits for rank 0's next command: an engine may sit idle for hours.
IDLE_TIMEOUT = timedelta(days=7)


def master_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a port the OS picks; workers learn it from `store.port`."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def worker_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )


class TPGroup:
    def __init__(self, store: dist.TCPStore, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.store = store
        self.failed: WorkerFailure | None = None
        self.collective_s = 0.0  # wall time spent in collectives (the bench's overhead share)
        try:  # the rendezvous: returns once every rank has joined
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        except RuntimeError as err:
            raise WorkerFailure(
                f"tensor-parallel rank {rank} could not join the group: {err}"
            ) from err

    # --- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or `op`) over ranks, in place (the row-parallel layers' one collective)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = op, self.timeout
        self._wait(lambda: self.pg.allreduce([t], opts), "all_reduce")
        return t

    def broadcast(self, t: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = self.timeout if timeout is None else timeout
        self._wait(lambda: self.pg.broadcast([t], opts), "broadcast")
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape everywhere) on rank 0; None on the others."""
        opts = dist.GatherOptions()
        opts.rootRank, opts.timeout = 0, self.timeout
        out = [[torch.empty_like(t) for _ in range(self.world_size)]] if self.rank == 0 else []
        self._wait(lambda: self.pg.gather(out, [t.contiguous()], opts), "gather")
        return out[0] if self.rank == 0 else None

    def send_object(self, obj: object) -> None:
        """Rank 0: one command to every worker. One broadcast of a fixed-size frame (the length,
        then the pickled bytes) when they fit, as a step's usually do; the rest in a second."""
        data = pickle.dumps(obj)
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[: FRAME_BYTES - 8]
        frame[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.broadcast(frame)
        if len(data) > len(head):
            self.broadcast(torch.frombuffer(bytearray(data[len(head) :]), dtype=torch.uint8))

    def recv_object(self) -> object:
        """Workers: the next command from rank 0; waits as long as the engine stays idle."""
        frame = self.broadcast(torch.empty(FRAME_BYTES, dtype=torch.uint8), timeout=IDLE_TIMEOUT)
        size = int(frame[:8].view(torch.int64).item())
        data = frame[8 : 8 + size].numpy().tobytes()
        if size > len(data):
            rest = self.broadcast(torch.empty(size - len(data), dtype=torch.uint8))
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _wait(self, start, what: str) -> None:
        if self.failed is not None:
            raise self.failed
        t0 = time.perf_counter()
        try:
            start().wait()
            self.collective_s += time.perf_counter() - t0
        except RuntimeError as err:  # gloo: peer closed, timeout, ...
            self.failed = WorkerFailure(
                f"tensor-parallel {what} failed on rank {self.rank} of {self.world_size} "
                f"(a worker died or hung): {err}"
            )
            raise self.failed from err

    def close(self) -> None:
        self.pg = None  # the sockets close with the gloo context
        self.store = None
