"""Chunked prefill and decode-heavy budgets."""

from __future__ import annotations

from kvpage.verify.case import Case, RequestSpec, Tokens, greedy


def batching_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=101)
    long_prompt = RequestSpec("long", t.take(160), greedy(8))
    # Several short prompts mid-prefill at once while others decode: chunk boundaries everywhere.
    shorts = [
        RequestSpec(f"short{i}", t.take(5 + i % 6), greedy(40), arrive_step=1) for i in range(12)
    ]
    decode_heavy = Case(
        "batching",
        "decode_heavy_budget8",
        [long_prompt, *shorts],
        dict(block_size=8, num_blocks=128, max_num_batched_tokens=8),
    )
    specs = [RequestSpec(f"c{i}", t.take(20 + 13 * i), greedy(24), arrive_step=i) for i in range(8)]
    chunked = Case(
        "batching",
        "chunked_budget32",
        specs,
        dict(block_size=16, num_blocks=96, max_num_batched_tokens=32),
    )
    return [decode_heavy, chunked]
