"""KVStorage.read_slots against the one dim-1 select it replaced, on a shared-prefix step's
gather (31 chunks, each reading 512 shared + 32 own slots), interleaved round by round:

    python bench/kv_read_slots.py [--rounds 9] [--threads 2] [--layers 12]

Prints per dtype ms per step (`--layers` calls, min and median) and the old/new ratio."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpage.host_memory import keep_freed_memory
from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVStorage

CHUNKS, SHARED, OWN, BLOCK = 31, 512, 32, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as an engine does: the copies reuse freed memory
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        storage = KVStorage(1, 4096, BLOCK, 4, 64, kv_format("auto", dtype), "cpu")
        storage.data.copy_(torch.randn(storage.data.shape, generator=g))
        shared = torch.arange(SHARED) + 5 * BLOCK
        own = [
            torch.randint(SHARED + 8 * BLOCK, 4096 * BLOCK, (OWN,), generator=g)
            for _ in range(CHUNKS)
        ]
        slots = torch.cat([torch.cat((shared, o)) for o in own])

        def old(slots=slots, storage=storage):
            kv = storage.data[0].flatten(1, 2).index_select(1, slots)
            return kv[0], kv[1]

        def new(slots=slots, storage=storage):
            return storage.read_slots(0, slots)

        assert all(torch.equal(a, b) for a, b in zip(old(), new(), strict=True))
        times: dict[str, list[float]] = {"dim-1 select": [], "read_slots": []}
        for _ in range(args.rounds):
            for name, fn in (("dim-1 select", old), ("read_slots", new)):
                t0 = time.perf_counter()
                for _ in range(args.layers):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, v in times.items():
            print(
                f"{str(dtype):15s} {name:13s} min {min(v):7.2f} med {statistics.median(v):7.2f} ms"
            )
        o, n = times["dim-1 select"], times["read_slots"]
        best, med = min(o) / min(n), statistics.median(o) / statistics.median(n)
        print(f"{str(dtype):15s} old/new {best:.2f}x ({med:.2f}x)")


if __name__ == "__main__":
    main()
