"""Seeded sampling. Every request here samples; each is diffed token by token against
the reference run alone with the same seed, so a draw that depends on the batch, a generator
shared across rows or re-seeded after a preemption is a divergence. The draws themselves are
checked against the independent sampling oracle: each must be possible, and all of a case's draws
together must follow the oracle's distribution (kvpage.verify.sampling_oracle)."""

from __future__ import annotations

from dataclasses import replace

from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec, Tokens, forced_preemption_case, preempt_once_added

B = 8
SETTINGS = (  # (temperature, top_k, top_p)
    (0.7, -1, 1.0),
    (1.0, 20, 1.0),
    (1.0, -1, 0.9),
    (1.3, 50, 0.95),
    (0.5, 5, 0.8),
    (2.0, -1, 1.0),
)


def sampling_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=808)
    cases = [_seeded_batch(t)]
    cases += [_seeded_preempted(t, mode) for mode in ("recompute", "swap")]
    cases.append(_unseeded(Tokens(vocab, seed=809)))
    return cases


def _params(i: int, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    temperature, top_k, top_p = SETTINGS[i % len(SETTINGS)]
    return SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=1000 + i,
        ignore_eos=True,
        logprobs=logprobs,
    )


def _seeded_batch(t: Tokens) -> Case:
    """36 seeded requests in a batch (chunked: budget 64), logprobs on a third of them."""
    specs = [
        RequestSpec(
            f"s{i}", t.take(5 + 3 * (i % 7)), _params(i, 32, 3 if i % 3 == 0 else None), i // 6
        )
        for i in range(36)
    ]
    return Case(
        "sampling",
        "seeded_batch",
        specs,
        dict(block_size=B, num_blocks=256, max_num_batched_tokens=64),
        check_sampling=True,
    )


def _seeded_preempted(t: Tokens, mode: str) -> Case:
    """Seeded requests preempted mid-decode (forced, and by a tiny pool): a replay after
    recompute or swap must continue the same generator, not restart it."""
    specs = [RequestSpec(f"p{i}", t.take(9 + 2 * i), _params(i, 28), i // 3) for i in range(9)]
    forced = [preempt_once_added(f"preempt p{i}", f"p{i}", 4 + i, 2, mode) for i in (0, 4, 8)]
    name = f"seeded_preempted_{mode}"
    return forced_preemption_case(
        "sampling", name, specs, forced, mode, (B, 30), 6, check_sampling=True
    )


def _unseeded(t: Tokens) -> Case:
    """Unseeded requests with one prompt: two with n = 4 and two with n = 1, submitted in
    different steps. Each sample must draw independently of every other (the engine seeds
    each sequence itself); each is diffed against the reference replaying its own seed, and
    all draws together must follow the oracle."""
    prompt = t.take(13)
    unseeded = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    specs = [
        RequestSpec("u4a", prompt, replace(unseeded, n=4)),
        RequestSpec("u1a", prompt, unseeded),
        RequestSpec("u4b", prompt, replace(unseeded, n=4), arrive_step=2),
        RequestSpec("u1b", prompt, unseeded, arrive_step=3),
    ]
    return Case(
        "sampling",
        "unseeded_independent",
        specs,
        dict(block_size=B, num_blocks=96),
        check_sampling=True,
    )
