"""Quantized KV: the prefix, batching and preemption suites again with the pool in
a quantized format, diffed against the reference with the same K/V round trip
(kvpage.reference.kv_oracle), plus greedy forks whose partial prompt block is copied on write (a CoW
must carry the block's scales with its codes). A copy of a suite is named `<suite>:<dtype>`."""

from __future__ import annotations

from dataclasses import replace

from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec, Tokens

# The suites whose cases run again in a quantized format.
REQUANTIZED_SUITES = ("prefix", "batching", "preemption")
B = 8


def quantized_copies(cases: list[Case], kv_cache_dtype: str) -> list[Case]:
    """The cases of REQUANTIZED_SUITES among `cases`, with the pool in `kv_cache_dtype`."""
    return [
        replace(
            case,
            suite=f"{case.suite}:{kv_cache_dtype}",
            engine={**case.engine, "kv_cache_dtype": kv_cache_dtype},
        )
        for case in cases
        if case.suite in REQUANTIZED_SUITES
    ]


def cow_case(vocab: int, kv_cache_dtype: str) -> Case:
    """Greedy n > 1: the samples share the prompt's partial last block and the first write of
    each but one copies it (n - 1 copies per request); every sample must equal the reference."""
    t = Tokens(vocab, seed=1414)
    specs = [
        RequestSpec(f"g{i}", t.take(length), SamplingParams(n=n, max_tokens=14, ignore_eos=True), i)
        for i, (length, n) in enumerate(((11, 2), (2 * B + 3, 3), (5, 2)))
    ]
    return Case(
        f"parallel:{kv_cache_dtype}",
        "greedy_forks_cow",
        specs,
        dict(block_size=B, num_blocks=64, kv_cache_dtype=kv_cache_dtype),
        expect_counters={"cow_copies": sum(s.params.n - 1 for s in specs)},
    )
