"""Cost of the verifier's tracer on the engine hot path: the same workload with tracing off
and on, interleaved, in one process. Prints median wall time and output tokens/s for each and the
ratio on/off. Off must cost nothing measurable (an empty observer list); on at most 25%.

    python bench/tracing.py [--model builtin:tiny-llama|HF_DIR] [--requests 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.model import load_model
from kvpage.verify.trace import EngineTracer


def workload(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]


def run_once(model, tok, prompts, params, trace: bool) -> tuple[float, float]:
    """(seconds in the step loop, seconds to read the trace: top-k and digests are summarised
    when the records are first read)."""
    engine = LLMEngine(EngineConfig(block_size=16, max_num_seqs=64), model, tok)
    if trace:
        engine.add_observer(EngineTracer(engine))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    loop = time.perf_counter() - start
    if trace:
        assert (
            sum(len(r) for r in engine.tracer.records.values()) == len(prompts) * params.max_tokens
        )
    return loop, time.perf_counter() - start - loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    prompts = workload(args.requests, min(model.config.vocab_size, 256), seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    run_once(model, tok, prompts[:4], params, trace=False)  # warm-up
    times = {False: [], True: []}
    reads = []
    for _ in range(args.repeats):
        for trace in (False, True):
            loop, read = run_once(model, tok, prompts, params, trace)
            times[trace].append(loop)
            reads.append(read) if trace else None
    tokens = args.requests * args.max_tokens
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"model {args.model}, {args.requests} requests x {args.max_tokens} tokens, "
        f"{args.repeats} repeats, medians:"
    )
    print(f"  tracing off: {off:.3f}s  {tokens / off:8.1f} tok/s")
    print(f"  tracing on:  {on:.3f}s  {tokens / on:8.1f} tok/s")
    print(f"  on/off time ratio: {on / off:.3f}  (limit 1.25)")
    print(f"  reading the trace afterwards (top-k, digests): {statistics.median(reads):.3f}s")


if __name__ == "__main__":
    main()
