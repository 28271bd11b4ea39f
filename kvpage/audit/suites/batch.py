"""Batch invariance: the baseline probes again, all at once (varied lengths sharing the server's
batches), each compared with its solo run. A request's output must not depend on its neighbours."""

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
    if not ctx.cold_refs:
        result.untested.append("no cache_salt: concurrency is tested together with cache hits")
    result.verdict = result.judged_verdict()
    result.summary = _summary(result)
    ctx.noise.drift_scale = drift_scale(result)
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
    return f"{len(result.checks)} probes concurrent vs solo; {n} diverged"
