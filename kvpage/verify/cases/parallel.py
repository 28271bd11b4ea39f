"""Parallel sampling: n = 2..4 samples forked after prefill share every prompt block,
the partial last one included, and copy it on their first write. Each sample is diffed against
the reference run alone with its derived seed; without preemption the copy count is exact
(n - 1 per prompt ending mid-block: concurrent CoW never double-copies)."""

from __future__ import annotations

from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec, Tokens, forced_preemption_case, preempt_once_added

B = 8


def parallel_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=909)
    cases = [_forks(t)]
    cases += [_forks_under_pressure(t, mode) for mode in ("recompute", "swap")]
    return cases


def _sampled(n: int, seed: int, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=0.9,
        top_p=0.95,
        top_k=40,
        max_tokens=max_tokens,
        seed=seed,
        ignore_eos=True,
    )


def _forks(t: Tokens) -> Case:
    lengths_and_n = ((11, 2), (13, 3), (2 * B + 5, 4), (2 * B, 3), (7, 2))
    specs = [
        RequestSpec(f"fork{i}", t.take(length), _sampled(n, 70 + i), arrive_step=i)
        for i, (length, n) in enumerate(lengths_and_n)
    ]
    greedy = SamplingParams(n=2, max_tokens=12, ignore_eos=True)
    specs.append(RequestSpec("greedy-fork", t.take(9), greedy, arrive_step=2))
    copies = sum(s.params.n - 1 for s in specs if len(s.prompt) % B)
    return Case(
        "parallel",
        "forks_n2_to_4",
        specs,
        dict(block_size=B, num_blocks=128),
        expect_counters={"cow_copies": copies},
        check_sampling=True,
    )


def _forks_under_pressure(t: Tokens, mode: str) -> Case:
    specs = [
        RequestSpec(f"x{i}", t.take(9 + 3 * i), _sampled(3, 90 + i, 24), arrive_step=i)
        for i in range(5)
    ]
    preempt_child = preempt_once_added(
        "preempt sample x0#1 after 3 tokens", "x0", 3, 2, mode, "x0#1"
    )
    name = f"forks_tiny_pool_{mode}"
    return forced_preemption_case("parallel", name, specs, [preempt_child], mode, (B, 26), 2)
