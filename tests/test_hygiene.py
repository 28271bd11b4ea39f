"""No dead code: one ceiling-division helper for block counts, every counter the cache keeps is
reported, and no stats key is exported twice under two names."""

from __future__ import annotations

import re
from pathlib import Path

from kvpage import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1] / "kvpage"


def test_block_counts_use_the_one_helper():
    copies = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in ROOT.rglob("*.py")
        if path.name != "block_table.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"-\(-", line)
    ]
    assert not copies, f"ceiling divisions outside blocks_for: {copies}"


def test_key_collisions_are_reported():
    llm = LLM("builtin:tiny-llama", block_size=8, num_blocks=512, fast_key_bits=4)
    prompts = [[3 + (i * 7 + j * 13) % 250 for j in range(17)] for i in range(40)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    stats = llm.stats()
    assert stats["key_collisions"] > 0  # 80 full blocks into 16 fast keys


def test_stats_keys_are_not_exported_twice():
    stats = LLM("builtin:tiny-llama", num_blocks=16).stats()
    assert "allocations" not in stats and "frees" not in stats
    assert {"block_allocations", "block_frees", "key_collisions"} <= set(stats)
