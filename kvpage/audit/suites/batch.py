"""Batch invariance: the baseline probes again, all at once (varied lengths sharing the server's
batches), each compared with its solo run. A request's output must not depend on its neighbours.

Then pressure: twice as many long requests at once, more KV than a small pool holds (so a small
server preempts, swaps or recomputes, evicts and reuses blocks), each judged against its solo
answer; and prompts cached before that flood are sent again — their blocks were evicted and
reused meanwhile — and judged against their first answers."""

from __future__ import annotations

from kvpage.audit.classify import ISOLATION
from kvpage.audit.compare import max_logprob_delta
from kvpage.audit.suites.base import UNTESTABLE, SuiteContext, SuiteResult

NAME = "batch"


def run(ctx: SuiteContext) -> SuiteResult:
    result = ctx.start(NAME, UNTESTABLE)
    if len(ctx.solo) < 2:
        result.untested.append("needs the baseline probes (baseline suite did not finish)")
        return result
    ctx.attempt(result, "concurrent probes", lambda: _together(ctx, result))
    # batching alone sets the drift scale the pressure round (and later suites) are held to
    ctx.noise.drift_scale = drift_scale(result)
    ctx.attempt(result, "pressure", lambda: _pressure(ctx, result))
    if not ctx.cold_refs:
        result.untested.append(f"{ctx.no_cold}: concurrency is tested together with cache hits")
    result.verdict = result.judged_verdict()
    result.summary = _summary(result)
    result.data = {"drift_scale": ctx.noise.drift_scale}
    return result


def _together(ctx: SuiteContext, result: SuiteResult) -> None:
    names = list(ctx.solo)
    tenants = [ctx.cold() for _ in names]  # cold where possible: batching alone is under test
    calls = [
        (lambda p=ctx.solo[n][0], t=t: ctx.session.complete(p, tenant=t))
        for n, t in zip(names, tenants, strict=True)
    ]
    outputs = ctx.session.concurrently(calls)
    cache = "cold (fresh salts)" if ctx.cold_refs else "may hit the solo runs' cache"
    for name, out in zip(names, outputs, strict=True):
        context = {
            "mode": f"{len(names)} concurrent requests",
            "concurrent_with": [n for n in names if n != name],
            "cache": cache,
        }
        ref = ctx.solo[name][1]
        result.checks.append(ctx.judge(NAME, name, ref, out, context, both_cold=ctx.cold_refs))


MARKERS = 3  # prompts cached before the flood and sent again after it


def requests(probes: int) -> int:
    """What the suite sends (the budget planner's estimate)."""
    return probes + 2 * (2 * probes) + 2 * MARKERS


def _pressure(ctx: SuiteContext, result: SuiteResult) -> None:
    longest = max(ctx.cfg.block_sizes)
    markers = [ctx.factory.random(longest + 5 + 7 * i) for i in range(MARKERS)]
    first = [ctx.session.complete(m) for m in markers]  # fresh prompts: cold
    prompts = [ctx.factory.random(2 * longest + 3 * i) for i in range(2 * ctx.cfg.probes)]
    tokens = longest // 2 + 8
    calls = [lambda p=p: ctx.session.complete(p, tokens) for p in prompts]
    outs = ctx.session.concurrently(calls)
    refs = [ctx.session.complete(p, tokens, tenant=ctx.cold()) for p in prompts]
    mode = {"mode": f"pressure: {len(prompts)} long requests at once"}
    for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
        result.checks.append(ctx.judge(NAME, f"pressure{i}", ref, out, mode))
    after = {"mode": "cached before the pressure, sent again after it"}
    for i, (ref, marker) in enumerate(zip(first, markers, strict=True)):
        again = ctx.session.complete(marker)
        result.checks.append(ctx.judge(NAME, f"marker{i}", ref, again, after))


def drift_scale(result: SuiteResult) -> float | None:
    """How far logprobs move under batching alone: the largest |Δ| before any flip, over the
    probes not found to be isolation failures (None: nothing measured)."""
    deltas = []
    for check in result.checks:
        if check.klass == ISOLATION:
            continue
        div = check.divergence
        upto = None if div is None or div.logprob_only else div.index
        delta = max_logprob_delta(check.ref, check.cand, upto)
        if delta is not None:
            deltas.append(delta)
    return max(deltas) if deltas else None


def _summary(result: SuiteResult) -> str:
    n = len(result.divergences)
    return f"{len(result.checks)} answers under concurrency or pressure vs solo; {n} diverged"
