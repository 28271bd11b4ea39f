"""Cache policy: what must be a hit is a hit, what must not be is not.

- eviction order: a reused prefix outlives a newer one nobody reused (leaf-first LRU by last
  release), so after memory pressure the reused one still hits and the other misses;
- narrow (8-bit) fast keys: one genuinely shared first block and many distinct second blocks,
  so fast keys collide below the root; the digest is confirmed at every depth and every probe
  gets exactly the shared block;
- prefix counters under preemption: prefix_hits equals the sum of num_cached_tokens (checked on
  every case by kvpage.verify.checks) with requests re-admitted after recompute;
- prefix sharing inside one step: requests submitted together that share full blocks compute
  them once (the later ones wait one step for the first one's blocks, kvpage.engine.scheduler),
  per namespace, while a request that shares nothing is not held up: exact hit tokens and an
  exact count of prompt tokens fed to the model."""

from __future__ import annotations

from kvpage.verify.case import Case, RequestSpec, Tokens, greedy

B = 8


def policy_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=606)
    # The newest case draws its own tokens, so the older cases keep theirs.
    return [
        _same_step_sharing(Tokens(vocab, seed=607)),
        _eviction_order(t),
        _narrow_fast_keys(t),
        _counters_under_preemption(t),
    ]


def _same_step_sharing(t: Tokens) -> Case:
    """All submitted before the first step. "w" writes the 3-block prefix; s0..s3, a full+1
    prompt and a one-block sharer hit what it wrote; tenant B's pair shares only among itself
    (another namespace); "solo" shares nothing. Each full block is computed once per namespace."""
    prefix = t.take(3 * B)
    specs = [RequestSpec("w", prefix + t.take(5), greedy(4))]
    specs += [RequestSpec(f"s{i}", prefix + t.take(5), greedy(4)) for i in range(4)]
    specs += [
        RequestSpec("full_plus_1", prefix + t.take(1), greedy(4)),
        RequestSpec("one_block", prefix[:B] + t.take(6), greedy(4)),
        RequestSpec("b.w", prefix + t.take(5), greedy(4), cache_salt="tenant-b"),
        RequestSpec("b.s", prefix + t.take(5), greedy(4), cache_salt="tenant-b"),
        RequestSpec("solo", t.take(20), greedy(4)),
    ]
    hits = {s.request_id: 3 * B for s in specs}
    hits.update({"w": 0, "one_block": B, "b.w": 0, "solo": 0})
    # The prefix once per namespace plus every private tail: 110 of 262 prompt tokens.
    prompt_tokens = sum(len(s.prompt) for s in specs)
    return Case(
        "policy",
        "same_step_sharing",
        specs,
        dict(block_size=B, num_blocks=64),
        expect_hit_tokens=hits,
        expect_counters={"prefill_tokens": prompt_tokens - sum(hits.values())},
    )


def _eviction_order(t: Tokens) -> Case:
    """16 blocks. R and U each leave 2 cached blocks; R is reused after U was cached; a filler
    that needs 14 blocks evicts exactly 2: U's (least recently released), not R's."""
    reused, unused = t.take(2 * B), t.take(2 * B)
    specs = [
        RequestSpec("R", reused + t.take(2), greedy(3)),
        RequestSpec("U", unused + t.take(2), greedy(3), arrive_step=6),
        RequestSpec("R.reuse", reused + t.take(3), greedy(3), arrive_step=12),
        RequestSpec("filler", t.take(100), greedy(12), arrive_step=18),
        RequestSpec("R.after", reused + t.take(4), greedy(3), arrive_step=40),
        RequestSpec("U.after", unused + t.take(4), greedy(3), arrive_step=46),
    ]
    return Case(
        "policy",
        "eviction_order",
        specs,
        dict(block_size=B, num_blocks=16),
        expect_hit_tokens={"R": 0, "U": 0, "R.reuse": 2 * B, "R.after": 2 * B, "U.after": 0},
    )


def _narrow_fast_keys(t: Tokens) -> Case:
    first = t.take(B)
    fills = [
        RequestSpec(f"fill{i}", first + t.take(B) + t.take(3), greedy(2), arrive_step=i // 8)
        for i in range(24)
    ]
    probes = [
        RequestSpec(f"probe{i}", first + t.take(B) + t.take(2), greedy(2), arrive_step=8 + i // 8)
        for i in range(32)
    ]
    return Case(
        "policy",
        "narrow_fast_keys",
        fills + probes,
        dict(block_size=B, num_blocks=256, fast_key_bits=8, max_num_batched_tokens=4096),
        expect_hit_tokens={p.request_id: B for p in probes},
    )


def _counters_under_preemption(t: Tokens) -> Case:
    shared = t.take(3 * B)
    specs = [
        RequestSpec(f"r{i}", shared[: B * (1 + i % 3)] + t.take(5 + i), greedy(24), arrive_step=i)
        for i in range(10)
    ]
    return Case(
        "policy",
        "counters_under_preemption",
        specs,
        dict(block_size=B, num_blocks=22, preemption_mode="recompute"),
        expect_preemption=True,
    )
