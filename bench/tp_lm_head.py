"""Replicated vs vocab-parallel LM head under tensor parallelism on CPU (gloo), which kvpage's
sharding chose from (kvpage/distributed/sharding.py):

    python bench/tp_lm_head.py [--tp 2] [--shapes 64x259,768x32000,2048x128256] [--rows 1,32]
                               [--reps 50]

replicated: rank 0 alone computes the (M, V) logits with the full head (what kvpage does; the
workers compute nothing). vocab-parallel: every rank computes its (M, V/N) slice at the same
time, then a gather brings the slices to rank 0, which concatenates them. Both through the
oneDNN-prepacked `Projection` kvpage uses. Prints the median per call, in microseconds."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch import nn

from kvpage.model.projection import Projection
from kvpage.parallel.group import TPGroup, master_store, worker_store


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _head(hidden: int, vocab: int) -> Projection:
    lin = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    return Projection(lin)


def _parallel(group: TPGroup, hidden: int, vocab: int, rows: int, reps: int) -> float:
    head = _head(hidden, vocab // group.world_size)
    x = torch.randn(rows, hidden)

    def call():
        parts = group.gather(head(x)[0])
        if parts is not None:
            torch.cat(parts, dim=-1)

    return _time(call, reps)


def _worker(rank: int, world: int, port: int, cases, reps: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = TPGroup(worker_store(port, world, 60), rank, world, 60)
    with torch.inference_mode():
        for hidden, vocab, rows in cases:
            _parallel(group, hidden, vocab, rows, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", default="64x259,768x32000,2048x128256")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    cases = [(h, v, r) for h, v in shapes for r in map(int, args.rows.split(","))]
    store = master_store(args.tp, 60)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, args.tp, store.port, cases, args.reps))
        for r in range(1, args.tp)
    ]
    for p in procs:
        p.start()
    group = TPGroup(store, 0, args.tp, 60)
    print(f"tp={args.tp}, {torch.get_num_threads()} threads on rank 0, median of {args.reps}")
    print(f"{'hidden x vocab':>16}{'rows':>6}{'replicated us':>15}{'vocab-par us':>14}")
    with torch.inference_mode():
        for hidden, vocab, rows in cases:
            head, x = _head(hidden, vocab), torch.randn(rows, hidden)
            rep = _time(lambda head=head, x=x: head(x), args.reps)
            par = _parallel(group, hidden, vocab, rows, args.reps)
            print(f"{f'{hidden}x{vocab}':>16}{rows:>6}{rep:>15.0f}{par:>14.0f}")
    for p in procs:
        p.join(30)


if __name__ == "__main__":
    main()
