"""Forced preemption: the A/B/C script, on tiny pools so freed blocks are reused at once."""

from __future__ import annotations

from kvpage.verify.case import (
    Case,
    RequestSpec,
    Tokens,
    after_one_preemption,
    forced_preemption_case,
    greedy,
    preempt_at_step,
    preempt_once_added,
    preempting_engine,
    with_canaries,
)


def _abc_script(t: Tokens, mode: str) -> Case:
    """The A/B/C script: A long prefill + short decode; B shares A's prefix and ends quickly; C long
    decode, preempted at its 8th token; B frees its private blocks; C resumes and must match."""
    B = 8
    prefix = t.take(5 * B)
    specs = [
        RequestSpec("A", prefix + t.take(6), greedy(6)),
        RequestSpec("B", prefix[: 3 * B] + t.take(4), greedy(3), arrive_step=2),
        RequestSpec("C", t.take(9), greedy(40), arrive_step=2),
    ]
    specs = with_canaries(specs, 256, seed=7)
    preempt = preempt_once_added("preempt C at token 8", "C", 8, 6, mode)
    counters = after_one_preemption(mode)
    return forced_preemption_case(
        "preemption", f"abc_{mode}", specs, [preempt], mode, (B, 16), 6, expect_counters=counters
    )


def preemption_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=202)
    cases = [_abc_script(t, "swap"), _abc_script(t, "recompute")]
    shared = t.take(24)
    for mode in ("swap", "recompute"):
        specs = [
            RequestSpec(
                f"r{i}", shared[: 8 * (i % 3)] + t.take(6 + i), greedy(32), arrive_step=i // 4
            )
            for i in range(12)
        ]
        cases.append(
            Case(
                "preemption",
                f"tiny_pool_{mode}",
                with_canaries(specs, vocab, 9),
                preempting_engine(mode, 8, num_blocks=28, swap_space_blocks=128),
                expect_preemption=True,
            )
        )
    specs = [RequestSpec(f"f{i}", t.take(10 + 3 * i), greedy(24)) for i in range(6)]
    plan = [
        ("f0", 0, 2, "swap"),
        ("f2", 7, 1, "recompute"),
        ("f4", 15, 3, "swap"),
        ("f5", 23, 1, "recompute"),
    ]
    actions = [preempt_at_step(f"preempt {r} after {k}", 0, r, k, n, m) for r, k, n, m in plan]
    cases.append(
        Case(
            "preemption",
            "forced_schedule",
            specs,
            dict(block_size=8, num_blocks=64, swap_space_blocks=64),
            actions=actions,
            expect_preemption=True,
            expect_counters={"preemptions": 4},
            hold_steps=7,
        )
    )
    return cases
