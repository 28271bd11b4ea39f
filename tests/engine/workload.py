"""Deterministic prompt sets for differential tests: shared prefixes of 0, 1 and 3 full blocks,
full+1 and full-1 tokens, and exact duplicates of k full blocks (a fully cached prompt)."""

from __future__ import annotations

import random

from kvpage import SamplingParams
from kvpage.reference.generator import generate

# (name, shared prefix length in units of block size B, plus a token offset)
PREFIX_GROUPS = [
    ("none", 0, 0),
    ("one_block", 1, 0),
    ("three_blocks", 3, 0),
    ("full_plus_1", 1, +1),
    ("full_minus_1", 1, -1),
    ("exact_two_blocks", 2, 0),  # identical prompts of exactly 2 blocks: last token recomputed
]


def prefix_prompts(block_size: int, vocab: int, n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed * 1000 + block_size)
    shared = [rng.randrange(3, vocab) for _ in range(3 * block_size + 1)]
    prompts = []
    for i in range(n):
        name, blocks, offset = PREFIX_GROUPS[i % len(PREFIX_GROUPS)]
        length = blocks * block_size + offset
        if name == "exact_two_blocks":
            prompts.append(shared[:length])
            continue
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 2 * block_size))]
        prompts.append(shared[:length] + tail)
    return prompts


class ReferenceCache:
    """Reference outputs computed once per (prompt, params): each request alone, contiguous KV."""

    def __init__(self, model) -> None:
        self.model = model
        self._memo: dict[tuple, list[int]] = {}

    def tokens(self, prompt: list[int], params: SamplingParams, fallback_seed: int = 0):
        key = (tuple(prompt), params, fallback_seed)
        if key not in self._memo:
            self._memo[key] = generate(self.model, prompt, params, fallback_seed).token_ids
        return self._memo[key]
