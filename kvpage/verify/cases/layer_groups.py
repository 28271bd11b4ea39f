"""Per-layer-group KV (kvpage.cache.groups) on a hybrid model (builtin:tiny-hybrid: 1 global :
2 window layers, window 12): prefix sharing whose hits end on each side of the window's edge, long
decodes whose window groups give blocks back, and preemption (swap and recompute, forced and
under a tight pool) whose restore must bring back exactly each group's window. Every step's
group views are diffed against the reference's windows (kvpage.verify.group_views)."""

from __future__ import annotations

from kvpage.verify.case import (
    Case,
    RequestSpec,
    Tokens,
    greedy,
    preempt_at_step,
    preempting_engine,
    with_canaries,
)

B = 8


def _prefix_across_the_edge(t: Tokens) -> Case:
    """Prompts sharing 1..4 blocks with a first one: each hit ends at another position relative
    to the window (its window groups need 2 blocks of it, not the whole prefix)."""
    shared = t.take(4 * B + 3)
    specs = [RequestSpec("p0", shared + t.take(5), greedy(20))]
    specs += [
        RequestSpec(f"p{k}", shared[: k * B + off] + t.take(3 + k), greedy(12), arrive_step=3)
        for k, off in ((1, 0), (2, 3), (3, 5), (4, 0))
    ]
    return Case(
        "layer_groups",
        "prefix_across_window_edge",
        with_canaries(specs, 256, seed=31),
        dict(block_size=B, num_blocks=64),
        expect_hit=("p2", "p3", "p4"),
    )


def _long_decodes(t: Tokens) -> Case:
    specs = [RequestSpec(f"d{i}", t.take(5 + 14 * i), greedy(48 - 8 * i)) for i in range(2)]
    return Case(
        "layer_groups",
        "long_decodes_free_window_blocks",
        specs,
        dict(block_size=B, num_blocks=48, max_num_batched_tokens=16),
    )


def _preempted(t: Tokens, mode: str) -> Case:
    shared = t.take(2 * B)
    specs = [
        RequestSpec(f"r{i}", shared[: B * (i % 3)] + t.take(4 + 3 * i), greedy(24), i // 3)
        for i in range(6)
    ]
    force = preempt_at_step(f"preempt r1 ({mode}) after 14", 0, "r1", 14, 2, mode)
    return Case(
        "layer_groups",
        f"window_preemption_{mode}",
        with_canaries(specs, 256, seed=37),
        preempting_engine(mode, B, num_blocks=10, swap_space_blocks=128),
        actions=[force],
        expect_preemption=True,
        hold_steps=2,
    )


def layer_group_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=2424)
    return [
        _prefix_across_the_edge(t),
        _long_decodes(t),
        _preempted(t, "swap"),
        _preempted(t, "recompute"),
    ]
