"""Cross-tenant timing (Gu et al., ICML 2025; PROMPTPEEK): a victim tenant caches a long fresh
prefix; the same prefix is then timed from the same tenant (warm), from a second tenant (second
API key, or another cache salt) and, as control, a fresh prefix of the same length (cold), in a
random order per trial. Mann–Whitney U tests with effect sizes decide, together with
usage.cached_tokens where the server reports it:

- shared across tenants: the second tenant is served from the victim's cache (cached tokens > 0,
  or its TTFT is significantly and clearly below cold and not slower than the victim's own hits);
- isolated: the same tenant's hits show (cached tokens, or TTFT below cold) and the second
  tenant's do not (no cached tokens, or TTFT significantly slower than the victim's hits);
- inconclusive: no cache reuse measurable even within one tenant, so absence proves nothing."""

from __future__ import annotations

import random

from kvpage.audit.classify import SERVER_ERRORS
from kvpage.audit.completion import Completion
from kvpage.audit.errors import RequestRejected
from kvpage.audit.session import Tenant
from kvpage.audit.stats import MannWhitney, mann_whitney, median
from kvpage.audit.suites.base import UNTESTABLE, SuiteContext, SuiteResult

NAME = "timing"
SHARED, ISOLATED, INCONCLUSIVE = "shared across tenants", "isolated", "inconclusive"
MIN_EFFECT = 0.5  # |rank-biserial| needed besides significance: a clear, not just a real, gap
TAIL_TOKENS = 8
ARMS = ("cold", "same", "cross")


def run(ctx: SuiteContext) -> SuiteResult:
    result = ctx.start(NAME, UNTESTABLE)
    victim, other, how = _tenants(ctx)
    if other is None:
        result.untested.append(how)
    samples: dict[str, list[Completion]] = {arm: [] for arm in ARMS}
    rng = random.Random((ctx.cfg.seed or 0) + 101)
    length = fit_length(ctx, victim, result)
    if length is None:
        return result
    for trial in range(ctx.cfg.timing_trials):
        ctx.attempt(
            result, f"trial{trial}", lambda: _trial(ctx, samples, victim, other, rng, length)
        )
    if len(samples["cold"]) < 3:
        result.untested.append("fewer than 3 timing trials succeeded")
        result.verdict = SERVER_ERRORS if result.server_errors else UNTESTABLE
        return result
    result.data = _data(samples, how, length, ctx.cfg.alpha, ctx.cfg.trust_usage)
    result.verdict, result.summary = _verdict(ctx, result.data, other is not None)
    if result.server_errors and result.verdict != SHARED:
        result.verdict = SERVER_ERRORS
        result.summary = f"{result.server_errors} request(s) failed; {result.summary}"
    return result


def _trial(
    ctx: SuiteContext,
    samples: dict[str, list[Completion]],
    victim: Tenant,
    other: Tenant | None,
    rng: random.Random,
    length: int,
) -> None:
    """The victim caches a fresh prefix; the arms are then timed in a random order. A trial
    counts only if all of its requests succeeded."""
    prefix = ctx.factory.random(length)
    ctx.session.first_token(prefix + ctx.factory.random(TAIL_TOKENS), victim)
    arms = [a for a in ARMS if a != "cross" or other is not None]
    rng.shuffle(arms)
    got = {}
    for arm in arms:
        head = ctx.factory.random(length) if arm == "cold" else prefix
        tenant = other if arm == "cross" else victim
        got[arm] = ctx.session.first_token(head + ctx.factory.random(TAIL_TOKENS), tenant)
    for arm, out in got.items():
        samples[arm].append(out)


def fit_length(ctx: SuiteContext, victim: Tenant, result: SuiteResult) -> int | None:
    """The longest prefix (from --timing-prefix-tokens, halving) the server accepts: a small
    context or KV pool refuses long prompts with a 4xx."""
    length, floor = ctx.cfg.timing_prefix_tokens, 4 * max(ctx.cfg.block_sizes)
    while True:
        try:
            ctx.session.first_token(ctx.factory.random(length + TAIL_TOKENS), victim)
            return length
        except RequestRejected as err:
            if err.status >= 500:
                result.errors.append(
                    {"scenario": "prefix length", "status": err.status, "message": err.message}
                )
                result.verdict = SERVER_ERRORS
                return None
            if length // 2 < floor:
                result.untested.append(f"no prefix length the server accepts ({err})")
                return None
            result.untested.append(f"{length}-token prefixes refused ({err.message}); halving")
            length //= 2


def _tenants(ctx: SuiteContext) -> tuple[Tenant, Tenant | None, str]:
    """The victim, the second tenant, and how the second tenant is made (or why it cannot be)."""
    cfg = ctx.cfg
    if cfg.second_api_key:
        return Tenant("victim", cfg.api_key), Tenant("other", cfg.second_api_key), "second API key"
    if ctx.caps.cache_salt:  # also when salts were seen to share a cache: that is the finding
        victim = Tenant("victim", cfg.api_key, ctx.factory.salt())
        return victim, Tenant("other", cfg.api_key, ctx.factory.salt()), "another cache_salt"
    why = "none: cross-tenant needs --second-api-key (the server takes no cache_salt)"
    return Tenant("victim", cfg.api_key), None, why


def _data(
    samples: dict[str, list[Completion]], how: str, length: int, alpha: float, trust_usage: bool
) -> dict:
    ttft = {arm: [c.ttft_s or 0.0 for c in outs] for arm, outs in samples.items()}
    reported = {arm: [c.cached_tokens for c in outs] for arm, outs in samples.items()}
    cached = reported  # what the verdict uses
    if not trust_usage:  # judged by TTFT alone; the counts are still shown
        cached = {arm: [None] * len(v) for arm, v in reported.items()}
    tests: dict[str, MannWhitney] = (
        {"same_vs_cold": mann_whitney(ttft["same"], ttft["cold"])} if ttft["same"] else {}
    )
    if ttft["cross"]:
        tests["cross_vs_cold"] = mann_whitney(ttft["cross"], ttft["cold"])
        tests["cross_vs_same"] = mann_whitney(ttft["cross"], ttft["same"], "greater")
    return {
        "second_tenant": how,
        "prefix_tokens": length,
        "ttft_s": ttft,
        "median_ttft_s": {arm: median(v) for arm, v in ttft.items()},
        "cached_tokens": cached,
        "reported_cached_tokens": reported,
        "tests": {name: t.to_json() for name, t in tests.items()},
        "alpha": alpha,
    }


def faster(test: dict | None, alpha: float) -> bool:
    """Significantly and clearly faster than the comparison arm."""
    return bool(test) and test["p"] < alpha and test["effect"] <= -MIN_EFFECT


def _reported(values: list[int | None]) -> bool:
    return bool(values) and all(v is not None for v in values)


def _verdict(ctx: SuiteContext, data: dict, has_cross: bool) -> tuple[str, str]:
    tests, cached, alpha = data["tests"], data["cached_tokens"], ctx.cfg.alpha
    same_hits = _reported(cached["same"]) and any(cached["same"])
    same_fast = faster(tests.get("same_vs_cold"), alpha)
    within = _within(same_hits, same_fast)
    if not has_cross:
        return UNTESTABLE, within
    cross_hits = _reported(cached["cross"]) and any(cached["cross"])
    cross_timed = cross_hits_by_time(tests, alpha, same_fast)
    if cross_hits or cross_timed:
        return SHARED, _shared_reason(data, cross_hits, cross_timed) + f"; {within}"
    cross_slower = bool(tests.get("cross_vs_same")) and tests["cross_vs_same"]["p"] < alpha
    if same_hits or (same_fast and cross_slower):
        return ISOLATED, f"the second tenant sees no reuse of the victim's prefix; {within}"
    if _reported(cached["same"]) and _reported(cached["cross"]):
        return ISOLATED, f"no prefix reuse reported at all (cached tokens 0); {within}"
    return (
        INCONCLUSIVE,
        f"reuse within one tenant is not measurable, or the second tenant is neither like it nor "
        f"like cold, so nothing is proven; {within}",
    )


def cross_hits_by_time(tests: dict, alpha: float, same_fast: bool) -> bool:
    """The second tenant is timed like a cache hit: clearly faster than cold, and not slower
    than the victim's own tenant (whose hits must show, or there is nothing to be like). Both
    conditions guard against a chance low p among the three tests."""
    if not (same_fast and faster(tests.get("cross_vs_cold"), alpha)):
        return False
    return tests["cross_vs_same"]["p"] >= alpha


def _within(same_hits: bool, same_fast: bool) -> str:
    seen = "detected" if same_hits or same_fast else "not detected"
    cached = "> 0" if same_hits else "not > 0"
    timed = "faster" if same_fast else "not faster"
    return f"same-tenant reuse {seen} (cached tokens {cached}, TTFT {timed} than cold)"


def _shared_reason(data: dict, cross_hits: bool, cross_timed: bool) -> str:
    why = []
    if cross_hits:
        why.append(f"the second tenant got cached tokens {data['cached_tokens']['cross']}")
    if cross_timed:
        t = data["tests"]["cross_vs_cold"]
        why.append(
            f"its TTFT is below cold (p={t['p']:.2g}, effect {t['effect']:.2f}) and like the "
            "victim tenant's own"
        )
    if data["second_tenant"] == "another cache_salt":
        why.append(
            "tenants were told apart by cache_salt only: the server accepts the field without "
            "error, yet the salts share one cache (it ignores the field or does not key by it)"
        )
    return "; ".join(why)
