"""Resource paths, each in both preemption modes on tiny pools: abort during a chunked
prefill, timeout while swapped, preemption in the middle of a chunked prefill (the remainder is
larger than a whole step's budget), preemption of a request whose prefix came from the cache.
After each the baseline (free blocks, ref_counts, index size, swap space) must hold, and the
case must stay live."""

from __future__ import annotations

from kvpage.verify.case import (
    Action,
    Case,
    RequestSpec,
    Tokens,
    after_one_preemption,
    greedy,
    preempt_at_step,
    preempt_once_added,
    preempting_engine,
)

B = 8
MODES = ("swap", "recompute")


def resource_cases(vocab: int) -> list[Case]:
    cases = []
    for mode in MODES:
        t = Tokens(vocab, seed=707 if mode == "swap" else 708)
        cases += [
            _abort_in_chunked_prefill(t, mode),
            _preempt_mid_prefill(t, mode),
            _preempt_after_prefix_hit(t, mode),
        ]
    cases.append(_timeout_while_swapped(Tokens(vocab, seed=709)))
    cases.append(_parked_swap_does_not_block(Tokens(vocab, seed=710)))
    cases.append(_reservation_preemption_off(Tokens(vocab, seed=711)))
    return cases


def _engine(mode: str, num_blocks: int, **extra) -> dict:
    return preempting_engine(mode, B, num_blocks, **extra)


def _mid_prefill(engine, rid: str) -> bool:
    seq = engine.seqs.get(rid)
    return seq is not None and 0 < seq.num_computed < len(seq.prompt_ids)


def _abort_in_chunked_prefill(t: Tokens, mode: str) -> Case:
    specs = [
        RequestSpec("long", t.take(90), greedy(8)),
        RequestSpec("short0", t.take(9), greedy(20)),
        RequestSpec("short1", t.take(12), greedy(20), arrive_step=2),
    ]
    abort = Action(
        "abort 'long' halfway through its prefill",
        lambda e, s: _mid_prefill(e, "long") and e.seqs["long"].num_computed >= 32,
        lambda e: e.engine.abort_request("long"),
    )
    return Case(
        "resources",
        f"abort_in_chunked_prefill_{mode}",
        specs,
        _engine(mode, num_blocks=24, max_num_batched_tokens=16),
        actions=[abort],
        expect_finish={"long": "abort"},
    )


def _preempt_mid_prefill(t: Tokens, mode: str) -> Case:
    """Preempted after its first chunk with 80+ prompt tokens left and a 16-token budget: it
    must come back (in chunks) and not block the requests that arrive after it."""
    specs = [
        RequestSpec("big", t.take(100), greedy(6)),
        RequestSpec("late0", t.take(10), greedy(12), arrive_step=3),
        RequestSpec("late1", t.take(13), greedy(12), arrive_step=4),
    ]
    preempt = Action(
        "preempt 'big' mid-prefill",
        lambda e, s: _mid_prefill(e, "big"),
        lambda e: e.force_preempt("big", after_tokens=0, resume_after_steps=2, mode=mode),
    )
    return Case(
        "resources",
        f"preempt_mid_prefill_{mode}",
        specs,
        _engine(mode, num_blocks=40, max_num_batched_tokens=16),
        actions=[preempt],
        expect_preemption=True,
        expect_counters=after_one_preemption(mode),
        hold_steps=2,
    )


def _preempt_after_prefix_hit(t: Tokens, mode: str) -> Case:
    """B's prefix comes from A's published blocks; B is preempted mid-decode and resumes (swap:
    its shared blocks are copied out and restored privately; recompute: it hits again)."""
    prefix = t.take(3 * B)
    specs = [
        RequestSpec("A", prefix + t.take(3), greedy(4)),
        RequestSpec("B", prefix + t.take(5), greedy(24), arrive_step=6),
        RequestSpec("C", t.take(14), greedy(16), arrive_step=6),
    ]
    preempt = preempt_once_added("preempt B after 5 tokens", "B", 5, 3, mode)
    return Case(
        "resources",
        f"preempt_after_prefix_hit_{mode}",
        specs,
        _engine(mode, num_blocks=20),
        actions=[preempt],
        expect_hit_tokens={"B": 3 * B},
        expect_preemption=True,
        hold_steps=3,
    )


def _timeout_while_swapped(t: Tokens) -> Case:
    """Parked in swap until its deadline passes: the timeout must free its swap space."""
    specs = [
        RequestSpec("parked", t.take(12), greedy(40), timeout_s=1.0),
        RequestSpec("other", t.take(10), greedy(12)),
    ]
    # Parked after its first token: a second on any machine is far more than one step.
    park = preempt_at_step("park 'parked' in swap", 0, "parked", 1, 10**6, "swap")
    return Case(
        "resources",
        "timeout_while_swapped",
        specs,
        _engine("swap", num_blocks=24),
        actions=[park],
        expect_finish={"parked": "timeout", "other": "length"},
        expect_counters={"timeouts": 1, "swap_outs": 1, "swap_ins": 0},
        hold_steps=10**6,
    )


def _parked_swap_does_not_block(t: Tokens) -> Case:
    """A request held in swap for 30 steps must not hold up the requests that arrive meanwhile:
    only a swapped request that is ready to come back goes before new admissions."""
    specs = [
        RequestSpec("held", t.take(10), greedy(12)),
        *(RequestSpec(f"new{i}", t.take(8 + i), greedy(6), arrive_step=4) for i in range(3)),
    ]
    park = preempt_at_step("hold 'held' in swap for 30 steps", 0, "held", 2, 30, "swap")
    return Case(
        "resources",
        "parked_swap_does_not_block",
        specs,
        _engine("swap", num_blocks=32),
        actions=[park],
        expect_counters={"swap_ins": 1},
        hold_steps=30,
    )


def _reservation_preemption_off(t: Tokens) -> Case:
    """Preemption switched off before the first step, on a pool that holds the worst case of
    five of the eight requests at once (4 blocks each of 22): admission must reserve every
    running request's growth (none may stall for a block) and still admit a request whenever
    its worst case fits what is left."""
    specs = [
        RequestSpec(f"r{i}", t.take(10 + i % 3), greedy(18), arrive_step=i // 4) for i in range(8)
    ]
    switch_off = Action(
        "switch preemption off", lambda e, s: s == 0, lambda e: e.engine.set_preemption(False)
    )
    return Case(
        "resources",
        "reservation_preemption_off",
        specs,
        _engine("recompute", num_blocks=22),
        actions=[switch_off],
        expect_finish={s.request_id: "length" for s in specs},
    )
