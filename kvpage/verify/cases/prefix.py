"""The deterministic prefix set: shared prefixes of 0/1/several blocks, full±1, exact blocks,
multi-turn nesting, conflicting formats, tenants, many distinct keys, evict-and-reuse."""

from __future__ import annotations

from kvpage.verify.case import Case, RequestSpec, Tokens, greedy, with_canaries


def prefix_cases(vocab: int, block_size: int) -> list[Case]:
    B = block_size
    t = Tokens(vocab, seed=B)
    shared = t.take(3 * B + 1)
    groups = [("p0", 0), ("p1", B), ("p3", 3 * B), ("full+1", B + 1), ("full-1", B - 1)]
    specs = []
    for wave in range(2):
        for name, n in groups:
            specs.append(
                RequestSpec(
                    f"{name}.{wave}",
                    shared[:n] + t.take(5 + wave),
                    greedy(16),
                    arrive_step=3 * wave,
                )
            )
    specs = with_canaries(specs, vocab, seed=B)
    exact = [
        RequestSpec(f"exact2.{i}", shared[: 2 * B], greedy(12), arrive_step=4 * i) for i in range(2)
    ]  # a fully cached prompt of exactly 2 blocks
    cases = [
        Case(
            "prefix",
            f"shared_prefixes_b{B}",
            specs + exact,
            dict(block_size=B, num_blocks=160),
            expect_hit=("p1.1", "p3.1", "full+1.1", "exact2.1"),
        )
    ]
    cases.append(_multi_turn_case(t, B))
    cases.append(_formats_case(t, B))
    cases.append(_tenant_case(t, B))
    cases.append(_many_distinct_case(t, B))
    cases.append(_evict_reuse_case(t, B))
    return cases


def _evict_reuse_case(t: Tokens, B: int) -> Case:
    """X's prefix is cached, evicted under pressure and its blocks reused by fillers; Z then asks
    for X's prefix while the fillers still hold those blocks: it must miss, not read them."""
    prefix = t.take(2 * B)
    specs = [RequestSpec("X", prefix + t.take(3), greedy(4))]
    # Two fillers take 10 of the 12 free blocks; the third needs 4, so X's 2 cached blocks are
    # evicted and handed to it. The first two finish fast, so Z is admitted while the third
    # still holds X's old blocks.
    sizes = ((4 * B + 1, 2), (4 * B + 1, 2), (3 * B + 1, 3 * B))
    specs += [
        RequestSpec(f"filler{i}", t.take(n), greedy(out), arrive_step=8)
        for i, (n, out) in enumerate(sizes)
    ]
    specs.append(RequestSpec("Z", prefix + t.take(2), greedy(4), arrive_step=9))
    return Case(
        "prefix",
        f"evict_reuse_b{B}",
        specs,
        dict(block_size=B, num_blocks=14),
        expect_no_hit=("Z",),
    )


def _multi_turn_case(t: Tokens, B: int) -> Case:
    """Nested histories: turn k+1's prompt extends turn k's prompt and answer (radix reuse)."""
    system, history, specs = t.take(B + 3), [], []
    history = list(system)
    for turn in range(4):
        history = history + t.take(B // 2 + 3 * turn + 1)
        specs.append(RequestSpec(f"turn{turn}", list(history), greedy(8), arrive_step=12 * turn))
        history = history + t.take(6)  # the "assistant answer" of this turn
    return Case(
        "prefix",
        f"multi_turn_b{B}",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_hit=("turn1", "turn2", "turn3"),
    )


def _formats_case(t: Tokens, B: int) -> Case:
    """Conflicting formats and topics; a block repeated at another depth (position alignment);
    a shared later block under different first blocks (chaining)."""
    json_head, prose_head, block_q, block_p = t.take(B), t.take(B), t.take(B), t.take(B)
    specs = [
        RequestSpec("json.a", json_head + block_q + t.take(4), greedy(12)),
        RequestSpec("prose.a", prose_head + block_q + t.take(4), greedy(12), arrive_step=3),
        RequestSpec("json.b", json_head + t.take(B + 3), greedy(12), arrive_step=3),
        RequestSpec("q-first", block_q + block_p + t.take(3), greedy(12), arrive_step=6),
        RequestSpec("p-then-q", block_p + block_q + t.take(2), greedy(12), arrive_step=6),
        RequestSpec("q-again", block_q + t.take(5), greedy(12), arrive_step=9),
    ]
    return Case(
        "prefix",
        f"formats_b{B}",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_hit=("json.b", "q-again"),
    )


def _tenant_case(t: Tokens, B: int) -> Case:
    prompt = t.take(3 * B + 2)
    specs = [
        RequestSpec("tenantA.1", prompt, greedy(8), cache_salt="tenant-A"),
        RequestSpec("tenantA.2", prompt, greedy(8), arrive_step=3, cache_salt="tenant-A"),
        RequestSpec("tenantB.1", prompt, greedy(8), arrive_step=3, cache_salt="tenant-B"),
        RequestSpec("nosalt.1", prompt, greedy(8), arrive_step=3),
    ]
    return Case(
        "prefix",
        f"tenants_b{B}",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_hit=("tenantA.2",),
        expect_no_hit=("tenantB.1", "nosalt.1"),
    )


def _many_distinct_case(t: Tokens, B: int) -> Case:
    """Many distinct published blocks, then distinct lookups: any fast-key collision that is
    served without its digest confirmed shows up as a step-0 divergence."""
    first = [RequestSpec(f"fill{i}", t.take(2 * B + 1), greedy(2)) for i in range(24)]
    second = [
        RequestSpec(f"probe{i}", t.take(2 * B + 1), greedy(4), arrive_step=6) for i in range(24)
    ]
    return Case(
        "prefix",
        f"many_distinct_b{B}",
        first + second,
        dict(block_size=B, num_blocks=256, max_num_batched_tokens=4096),
    )
