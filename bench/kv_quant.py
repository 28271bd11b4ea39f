"""Quantized KV cache: memory and speed against float32 KV, in one process:

    python bench/kv_quant.py [--model builtin:tiny-llama] [--dtypes auto,int8,fp8_e4m3]
                             [--memory-mib 64] [--requests 32] [--prompt 384] [--output 64]
                             [--budget-fraction 0.33] [--rounds 3] [--threads 2] [--seed 0]

(1) Blocks at a fixed `kv_cache_memory` (`--memory-mib`): what the pool gets in each KV dtype and
the ratio to float32 (`auto` on a float32 model). (2) A workload memory-bound at float32: all
`--requests` requests (`--prompt` random tokens, `--output` greedy tokens, EOS ignored) arrive at
once, and `kv_cache_memory` is set so that the float32 pool holds `--budget-fraction` of what they
need together (so float32 must preempt, by recompute). Every dtype runs once per round, one after
the other, for `--rounds` rounds (at least 3), so machine-load drift hits each alike; per dtype:
wall s (min / median), useful output tokens/s (from the min / median wall), preemptions, engine
steps (waiting behind preempted work shows here) and how many requests produced exactly the first
dtype's tokens.
CPU contention skews everything: run it on an otherwise idle machine."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from kvpage import LLM, SamplingParams
from kvpage.config import KV_CACHE_DTYPES
from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVStorage

BLOCK_SIZE = 16


@dataclass(slots=True)
class Runs:
    walls: list[float] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tokens: list[list[int]] | None = None  # output of the first round


def block_bytes(model_config, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    c = model_config
    fmt = kv_format(kv_cache_dtype, model_dtype)
    return KVStorage.bytes_per_block(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, fmt)


def blocks_table(args, dtypes: list[str]) -> None:
    memory = args.memory_mib * 2**20
    print(f"\n(1) blocks at kv_cache_memory = {args.memory_mib} MiB (block size {BLOCK_SIZE})")
    print(f"{'kv dtype':<12}{'bytes/block':>12}{'blocks':>10}{'vs auto':>9}")
    base = None
    for dtype in dtypes:
        llm = LLM(args.model, kv_cache_memory=memory, kv_cache_dtype=dtype)
        blocks = llm.engine.cache.pool.num_blocks
        base = base or blocks
        per = block_bytes(llm.engine.model.config, dtype, llm.engine.model.dtype)
        print(f"{dtype:<12}{per:>12}{blocks:>10}{blocks / base:>8.2f}x")


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, min(vocab, 256)) for _ in range(args.prompt)]
        for _ in range(args.requests)
    ]


def run_once(args, dtype: str, memory: int, prompts) -> tuple[float, dict, list[list[int]]]:
    llm = LLM(args.model, kv_cache_memory=memory, kv_cache_dtype=dtype, block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = dict(llm.stats(), steps=llm.engine.step_count)
    return wall, stats, [o.outputs[0].token_ids for o in outs]


def memory_bound_table(args, dtypes: list[str]) -> None:
    probe = LLM(args.model, num_blocks=1)
    mcfg, mdtype = probe.engine.model.config, probe.engine.model.dtype
    prompts = workload(args, mcfg.vocab_size)
    need_blocks = args.requests * -(-(args.prompt + args.output) // BLOCK_SIZE)
    memory = int(need_blocks * args.budget_fraction) * block_bytes(mcfg, "auto", mdtype)
    print(
        f"\n(2) memory-bound workload: {args.requests} requests x {args.prompt} prompt + "
        f"{args.output} output tokens, all at once, recompute preemption; kv_cache_memory = "
        f"{memory / 2**20:.2f} MiB = {args.budget_fraction:.0%} of the {need_blocks} float32 "
        f"blocks they need together; {args.rounds} rounds, interleaved"
    )
    for dtype in dtypes:  # warm-up, untimed
        run_once(args, dtype, memory, prompts[:2])
    runs = {d: Runs() for d in dtypes}
    for _ in range(args.rounds):
        for dtype in dtypes:
            wall, stats, tokens = run_once(args, dtype, memory, prompts)
            r = runs[dtype]
            r.walls.append(wall)
            r.preemptions.append(stats["preemptions"])
            r.steps.append(stats["steps"])
            r.tokens = r.tokens or tokens
    useful = args.requests * args.output
    print(
        f"{'kv dtype':<11}{'blocks':>7}{'wall min':>9}{'median':>8}{'tok/s best':>11}"
        f"{'median':>8}{'preempt':>8}{'steps':>7}{'same':>8}"
    )
    reference = runs[dtypes[0]].tokens
    for dtype in dtypes:
        r = runs[dtype]
        blocks = memory // block_bytes(mcfg, dtype, mdtype)
        best, median = min(r.walls), statistics.median(r.walls)
        same = sum(a == b for a, b in zip(r.tokens, reference, strict=True))
        print(
            f"{dtype:<11}{blocks:>7}{best:>9.2f}{median:>8.2f}{useful / best:>11.0f}"
            f"{useful / median:>8.0f}{statistics.median(r.preemptions):>8.0f}"
            f"{statistics.median(r.steps):>7.0f}{same:>5}/{len(reference)}"
        )
    base = runs[dtypes[0]]
    for dtype in dtypes[1:]:
        r = runs[dtype]
        print(
            f"{dtype} vs {dtypes[0]}: speed-up {min(base.walls) / min(r.walls):.2f}x (min) / "
            f"{statistics.median(base.walls) / statistics.median(r.walls):.2f}x (median)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--dtypes", default="auto,int8,fp8_e4m3", help="the first is the baseline")
    ap.add_argument("--memory-mib", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--budget-fraction", type=float, default=0.33)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    unknown = set(dtypes) - set(KV_CACHE_DTYPES)
    if unknown:
        ap.error(f"unknown --dtypes {sorted(unknown)}; choose from {KV_CACHE_DTYPES}")
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (min and median over interleaved rounds)")
    torch.set_num_threads(args.threads)
    print(f"model {args.model}, torch {torch.__version__}, {args.threads} threads")
    blocks_table(args, dtypes)
    memory_bound_table(args, dtypes)


if __name__ == "__main__":
    main()
