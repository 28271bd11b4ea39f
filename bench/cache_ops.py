"""Microbenchmark of the cache core: microseconds per allocate / lookup / publish / free for one
prompt of 1k, 4k and 16k tokens at block size 16 (pure Python, no tensors).

    python bench/cache_ops.py [--repeats N]

Lookup must be linear in the number of prompt blocks: the last lines print the cost ratio 16k/1k
next to the block ratio (16x); a ratio far above it would mean a hidden rescan.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvpage.cache import CacheNamespace, KVCacheManager

BLOCK_SIZE = 16
PROMPT_LENS = (1024, 4096, 16384)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def bench_prompt(prompt_len: int, repeats: int) -> dict[str, float]:
    n_blocks = prompt_len // BLOCK_SIZE
    m = KVCacheManager(2 * n_blocks + 8, BLOCK_SIZE)
    ns = CacheNamespace("bench-model@1", "bench-tok@1", block_size=BLOCK_SIZE)
    tokens = [(i * 7919) % 32000 for i in range(prompt_len)]
    samples: dict[str, list[float]] = {
        k: [] for k in ("hash", "allocate", "publish", "lookup", "free")
    }
    for _ in range(repeats):
        chain = m.new_key_chain(ns)
        samples["hash"].append(timed(lambda chain=chain: chain.extend(tokens)))
        owner = m.new_table(1)
        samples["allocate"].append(timed(lambda t=owner: m.append_slots(t, prompt_len)))
        samples["publish"].append(timed(lambda t=owner, c=chain: m.publish_full_blocks(t, c)))
        reader = m.new_table(2)
        samples["lookup"].append(
            timed(lambda t=reader, c=chain: m.acquire_prefix(t, c, prompt_len))
        )
        assert reader.num_tokens == prompt_len - BLOCK_SIZE  # every block but the last hit
        samples["free"].append(timed(lambda t=owner: m.free_table(t)))
        m.free_table(reader)
        m.evict(2 * n_blocks + 8)  # start the next repeat from an empty cache
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    print(
        f"block_size={BLOCK_SIZE}, median of {args.repeats} repeats, microseconds per call "
        f"(per block in brackets)"
    )
    ops = ("allocate", "lookup", "publish", "free", "hash")
    print(f"{'tokens':>7} {'blocks':>6} " + " ".join(f"{op:>18}" for op in ops))
    results = {}
    for n in PROMPT_LENS:
        r = results[n] = bench_prompt(n, args.repeats)
        nb = n // BLOCK_SIZE
        print(f"{n:>7} {nb:>6} " + " ".join(f"{r[op]:>9.1f} [{r[op] / nb:>5.2f}]" for op in ops))
    lo, hi = PROMPT_LENS[0], PROMPT_LENS[-1]
    block_ratio = hi / lo
    for op in ops:
        ratio = results[hi][op] / results[lo][op]
        print(
            f"{op:>8} cost ratio {hi}/{lo} tokens = {ratio:5.1f}x "
            f"(block ratio {block_ratio:.0f}x; linear if close)"
        )


if __name__ == "__main__":
    main()
