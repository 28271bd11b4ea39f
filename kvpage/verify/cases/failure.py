"""Failure paths: abort while waiting/running/swapped, timeout, swap-write failure,
cancelled recompute."""

from __future__ import annotations

from kvpage.engine.sequence import SeqStatus
from kvpage.verify.case import Action, Case, RequestSpec, Tokens, greedy, preempt_at_step, status_of


def failure_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=303)
    cases = []
    specs = [RequestSpec(f"w{i}", t.take(12 + i), greedy(20)) for i in range(5)]
    actions = [
        preempt_at_step("park w1 in swap", 0, "w1", 3, 10_000, "swap"),
        Action(
            "abort waiting w4, running w0, swapped w1",
            lambda e, s: status_of(e, "w1") is SeqStatus.SWAPPED,
            lambda e: [e.engine.abort_request(r) for r in ("w4", "w0", "w1")],
        ),
    ]
    cases.append(
        Case(
            "failure",
            "abort_waiting_running_swapped",
            specs,
            dict(block_size=8, num_blocks=64, max_num_seqs=3, swap_space_blocks=64),
            actions=actions,
            expect_finish={"w4": "abort", "w0": "abort", "w1": "abort"},
            expect_counters={"aborts": 3, "swap_space_used": 0},
        )
    )
    slow = RequestSpec("slow", t.take(10), greedy(2000), timeout_s=0.2)  # cannot finish in 0.2 s
    others = [RequestSpec(f"o{i}", t.take(9 + i), greedy(16)) for i in range(3)]
    cases.append(
        Case(
            "failure",
            "timeout",
            [slow, *others],
            dict(block_size=8, num_blocks=300),  # room for all 2000 tokens: only the clock stops it
            expect_finish={"slow": "timeout"},
            expect_counters={"timeouts": 1},
        )
    )
    specs = [RequestSpec(f"s{i}", t.take(10 + i), greedy(20)) for i in range(4)]
    actions = [
        Action(
            "fail the next swap write",
            lambda e, s: s == 0,
            lambda e: (e.fail_swap_writes(1), e.force_preempt("s1", 5, 2, "swap")),
        )
    ]
    cases.append(
        Case(
            "failure",
            "swap_write_failure",
            specs,
            dict(block_size=8, num_blocks=64, swap_space_blocks=64),
            actions=actions,
            expect_counters={"swap_failures": 1, "swap_outs": 0, "preemptions_recompute": 1},
        )
    )
    specs = [RequestSpec(f"c{i}", t.take(30 + i), greedy(20)) for i in range(3)]
    actions = [
        preempt_at_step("preempt c0 by recompute", 0, "c0", 4, 10_000, "recompute"),
        Action(
            "cancel c0's recompute",
            lambda e, s: status_of(e, "c0") is SeqStatus.WAITING and e.seqs["c0"].num_preemptions,
            lambda e: e.engine.abort_request("c0"),
        ),
    ]
    cases.append(
        Case(
            "failure",
            "cancel_recompute",
            specs,
            dict(block_size=8, num_blocks=64, enable_prefix_caching=False),
            actions=actions,
            expect_finish={"c0": "abort"},
        )
    )
    return cases
