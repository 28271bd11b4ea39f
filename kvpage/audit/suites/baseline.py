"""Baseline determinism: each probe twice, alone (cold both times where a fresh salt can make it
so). What differs here is the server's own run-to-run noise; every later suite is judged against
it, so a bug is never excused as "noise" larger than what the server shows alone."""

from __future__ import annotations

from kvpage.audit.classify import ISOLATION, Noise, logprob_resolution
from kvpage.audit.compare import max_logprob_delta
from kvpage.audit.suites.base import SuiteContext, SuiteResult

NAME = "baseline"


def probe_lengths(n: int, block_sizes: tuple[int, ...]) -> list[int]:
    """Varied prompt lengths on both sides of the candidate block sizes."""
    top = 3 * max(block_sizes)
    return [(5 + 23 * i) % top + 3 for i in range(n)]


def run(ctx: SuiteContext) -> SuiteResult:
    result = ctx.start(NAME, "exact")
    if not ctx.cold_refs:
        result.untested.append(
            f"{ctx.no_cold}: the repeat may be served from the first run's cache, so the noise "
            "measured includes cache hits"
        )
    for i, length in enumerate(probe_lengths(ctx.cfg.probes, ctx.cfg.block_sizes)):
        name = f"probe{i}"
        ctx.attempt(result, name, lambda n=name, k=length: _twice(ctx, result, n, k))
    ctx.noise = measure_noise(result)
    result.verdict, result.summary = _verdict(ctx.noise, ctx.caps.logprobs)
    hits = sum(1 for c in result.checks if c.klass == ISOLATION)
    if hits:
        result.summary = f"{hits} probe(s) changed after cached tokens under fresh salts; " + (
            result.summary
        )
    if ctx.noise.resolution:
        result.summary += (
            f"; logprobs come in steps of {ctx.noise.resolution:.3g} (tied top-k entries: a "
            "coarse dtype such as bf16), so a change within two steps is drift"
        )
    if result.server_errors or hits:
        result.verdict = result.judged_verdict()
    result.data = {
        "token_flips": ctx.noise.token_flips,
        "logprob_spread": ctx.noise.logprob_spread,
        "flip_margins": ctx.noise.flip_gaps,
        "logprob_resolution": ctx.noise.resolution,
    }
    return result


def _twice(ctx: SuiteContext, result: SuiteResult, name: str, length: int) -> None:
    prompt = ctx.factory.random(length)
    first = ctx.session.complete(prompt, tenant=ctx.cold())
    again = ctx.session.complete(prompt, tenant=ctx.cold())
    ctx.solo[name] = (prompt, first)
    context = {"prompt": prompt.describe(), "mode": "solo twice"}
    result.checks.append(ctx.judge(NAME, name, first, again, context, both_cold=ctx.cold_refs))


def measure_noise(result: SuiteResult) -> Noise:
    """The noise of the server alone. A pair already found to be an isolation failure (a cache
    hit under fresh salts) is not noise and does not widen it."""
    noise = Noise(measured=True)
    noise.resolution = logprob_resolution([a for c in result.checks for a in (c.ref, c.cand)])
    for check in (c for c in result.checks if c.klass != ISOLATION):
        div = check.divergence
        upto = None if div is None or div.logprob_only else div.index
        spread = max_logprob_delta(check.ref, check.cand, upto) or 0.0
        noise.logprob_spread = max(noise.logprob_spread, spread)
        if div is not None and not div.logprob_only:
            noise.token_flips += 1
            margin = div.cand_margin if div.cand_margin is not None else div.ref_gap
            if margin is not None:
                noise.flip_gaps.append(margin)
    for check in result.checks:  # the baseline's own differences are its noise, by definition
        if check.divergence is not None and check.klass != ISOLATION:
            check.klass, check.reason = "noise", "run-to-run difference of the server alone"
    return noise


def _verdict(noise: Noise, logprobs: bool) -> tuple[str, str]:
    if noise.token_flips:
        return "nondeterministic", f"{noise.token_flips} probe(s) changed tokens run to run alone"
    if noise.logprob_spread > 0:
        return "logprob noise", f"same tokens; logprobs vary by up to {noise.logprob_spread:.3g}"
    what = "tokens and logprobs" if logprobs else "text (no logprobs)"
    return "exact", f"identical {what} run to run"
