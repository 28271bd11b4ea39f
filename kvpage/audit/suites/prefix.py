"""Prefix reuse at block boundaries: fresh random prefixes shared for 0, 1, B-1, B and B+1
tokens for each candidate block size B, then whole prompts of 2B-1, 2B and 2B+1 tokens repeated,
sequential and concurrent; and the A/B/C pattern (A warms a prefix, B shares it, C arrives
while B decodes, sharing B's partial block). Every warm answer is judged against the same prompt
answered cold."""

from __future__ import annotations

import threading

from kvpage.audit.completion import Completion
from kvpage.audit.probes import Prompt
from kvpage.audit.stats import block_size_from_cached
from kvpage.audit.suites.base import UNTESTABLE, SuiteContext, SuiteResult

NAME = "prefix"
C_TOKENS = 4  # the A/B/C pattern's C: in and out while B decodes


def shares(block: int) -> list[int]:
    return sorted({0, 1, block - 1, block, block + 1})


def requests_per_block(cold_refs: bool) -> int:
    """What one block size costs (the budget planner's estimate)."""
    per_share = 4 if cold_refs else 3
    return len(shares(16)) * per_share + 6 + 8 + 5 + (4 if cold_refs else 0)


def run(ctx: SuiteContext) -> SuiteResult:
    result = ctx.start(NAME, UNTESTABLE)
    rows: list[dict] = []
    if not ctx.cold_refs:
        result.untested.append(
            f"{ctx.no_cold}: a prompt cannot be made cold once its prefix is cached, so partial "
            "shares are judged by re-sending the first (cold) prompt after its sharer"
        )
    for block in ctx.cfg.block_sizes:
        for s in shares(block):
            scenario = f"B{block}/share{s}"
            ctx.attempt(result, scenario, lambda b=block, s=s: _share(ctx, result, rows, b, s))
        for length in (2 * block - 1, 2 * block, 2 * block + 1):
            scenario = f"B{block}/repeat{length}"
            ctx.attempt(result, scenario, lambda b=block, n=length: _repeat(ctx, result, b, n))
        for s in (block - 1, block + 1):
            scenario = f"B{block}/concurrent{s}"
            ctx.attempt(result, scenario, lambda b=block, s=s: _concurrent(ctx, result, b, s))
        if ctx.cold_refs:
            ctx.attempt(result, f"B{block}/chain", lambda b=block: _chain(ctx, result, b))
        ctx.attempt(result, f"B{block}/ABC", lambda b=block: _abc(ctx, result, b))
    if not ctx.cold_refs:
        result.untested.append(
            f"key chaining (same block after different prefixes): needs a separating "
            f"cache_salt ({ctx.no_cold})"
        )
    result.verdict = result.judged_verdict()
    cached = [r["warm_cached_tokens"] for r in rows if r["warm_cached_tokens"] is not None]
    inferred = block_size_from_cached(cached)
    result.data = {"shares": rows, "block_size_from_cached_tokens": inferred}
    result.summary = (
        f"{len(result.checks)} warm answers judged against cold ones; "
        f"{len(result.divergences)} diverged"
        + (f"; cached-token counts imply block size {inferred}" if inferred else "")
    )
    return result


def _tail(ctx: SuiteContext, block: int, extra: int = 0) -> Prompt:
    return ctx.factory.random(max(3, block // 2 + 1) + extra)


def _share(ctx: SuiteContext, result: SuiteResult, rows: list, block: int, s: int) -> None:
    prefix = ctx.factory.random(s)
    x, y = prefix + _tail(ctx, block), prefix + _tail(ctx, block, 1)
    context = {"block_size": block, "shared_tokens": s, "mode": "sequential"}
    if ctx.cold_refs:
        ref = ctx.session.complete(y, tenant=ctx.cold())
        ctx.session.complete(x)  # warms the shared prefix
        warm = ctx.session.complete(y)
        again = ctx.session.complete(y)
        name = f"B{block}/share{s}"
        result.checks.append(ctx.judge(NAME, name, ref, warm, context))
        repeat = {**context, "mode": "full prompt repeated after a sharer"}
        result.checks.append(ctx.judge(NAME, f"{name}/repeat", ref, again, repeat))
    else:
        ref = ctx.session.complete(x)  # fresh prefix: cold
        warm = ctx.session.complete(y)  # shares s tokens; no cold answer to judge it by
        again = ctx.session.complete(x)
        context["mode"] = "first prompt again, after a sharer"
        result.checks.append(ctx.judge(NAME, f"B{block}/share{s}", ref, again, context))
    rows.append(_row(block, s, ref, warm))


def _row(block: int, s: int, cold: Completion, warm: Completion) -> dict:
    return {
        "block_size": block,
        "shared_tokens": s,
        "cold_latency_s": round(cold.latency_s, 6),
        "warm_latency_s": round(warm.latency_s, 6),
        "warm_cached_tokens": warm.cached_tokens,
    }


def _repeat(ctx: SuiteContext, result: SuiteResult, block: int, length: int) -> None:
    prompt = ctx.factory.random(length)
    first = ctx.session.complete(prompt)  # a fresh prompt is cold on any server
    again = ctx.session.complete(prompt)
    context = {"block_size": block, "prompt_tokens": length, "mode": "full prompt repeated"}
    result.checks.append(ctx.judge(NAME, f"B{block}/repeat{length}", first, again, context))


def _concurrent(ctx: SuiteContext, result: SuiteResult, block: int, s: int) -> None:
    prefix = ctx.factory.random(s)
    prompts = [prefix + _tail(ctx, block), prefix + _tail(ctx, block, 2)]
    outs = ctx.session.concurrently([lambda p=p: ctx.session.complete(p) for p in prompts])
    refs = [ctx.session.complete(p, tenant=ctx.cold()) for p in prompts]
    context = {"block_size": block, "shared_tokens": s, "mode": "two sharers at once"}
    for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
        name = f"B{block}/concurrent{s}/{'xy'[i]}"
        result.checks.append(ctx.judge(NAME, name, ref, out, context))


def _chain(ctx: SuiteContext, result: SuiteResult, block: int) -> None:
    """Keys must cover the whole prefix, not a block's own tokens: X1 = A+C and X2 = D+Q are
    cached, then Y = A+Q. Y may reuse block A only; a key of Q's tokens alone would also hand
    it X2's Q block, whose KV was computed after D."""
    a, q = ctx.factory.random(block), ctx.factory.random(block)
    ctx.session.complete(a + ctx.factory.random(block) + ctx.factory.random(3))
    ctx.session.complete(ctx.factory.random(block) + q + ctx.factory.random(3))
    y = a + q + ctx.factory.random(5)
    warm = ctx.session.complete(y)
    ref = ctx.session.complete(y, tenant=ctx.cold())
    context = {
        "block_size": block,
        "shared_tokens": block,
        "mode": "block 2 cached after another block 1",
    }
    result.checks.append(ctx.judge(NAME, f"B{block}/chain", ref, warm, context))


def _abc(ctx: SuiteContext, result: SuiteResult, block: int) -> None:
    """A warms; B shares and decodes long; C arrives while B decodes and shares B's prefix up
    to inside a block (the partial block a broken engine would share without copy-on-write)."""
    shared = block + block // 2
    prefix = ctx.factory.random(shared)
    a, b, c = (prefix + ctx.factory.random(n) for n in (3, 4, 5))
    # B decodes across new blocks long after C (short) has finished and released its share:
    # blocks freed too early are then reallocated under B.
    b_tokens = max(ctx.cfg.max_tokens, 3 * block)
    ctx.session.complete(a)
    b_out, c_out = _b_then_c(ctx, b, c, b_tokens)
    ref_b = ctx.session.complete(b, b_tokens, tenant=ctx.cold())
    ref_c = ctx.session.complete(c, C_TOKENS, tenant=ctx.cold())
    context = {"block_size": block, "shared_tokens": shared}
    for name, ref, out in (("B", ref_b, b_out), ("C", ref_c, c_out)):
        here = {**context, "mode": f"A/B/C: {name}"}
        result.checks.append(ctx.judge(NAME, f"B{block}/ABC/{name}", ref, out, here))


def _b_then_c(
    ctx: SuiteContext, b: Prompt, c: Prompt, b_tokens: int
) -> tuple[Completion, Completion]:
    """B streamed; C sent from another thread once B's first token is out (at once when the
    server cannot stream)."""
    c_out: list[Completion] = []
    errors: list[BaseException] = []

    def send_c() -> None:
        try:
            c_out.append(ctx.session.complete(c, C_TOKENS))
        except BaseException as err:  # handed to the caller's thread below
            errors.append(err)

    sender = threading.Thread(target=send_c, daemon=True)
    if ctx.caps.streaming:
        b_out = ctx.session.stream(b, b_tokens, on_first=sender.start)
        if sender.ident is None:  # no output chunk came: C goes now
            sender.start()
    else:
        sender.start()
        b_out = ctx.session.complete(b, b_tokens)
    sender.join()
    if errors:
        raise errors[0]
    return b_out, c_out[0]
