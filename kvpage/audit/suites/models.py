"""Isolation between the models a server lists (its base and LoRA adapters): a prefix cached
under one model must never be served to another (vLLM #3264: the adapter left out of the block
hash; #30931: two adapters sharing KV). For each pair (model_pairs.py) a round caches a fresh
prefix under each of the two models, then sends, under each model in turn (the viewer), three
arms in a random order: a fresh prefix (cold), its own cached prefix (same: the control that
must hit) and the other model's cached prefix (cross). Where a cache salt separates caches, the
other model's prefix is also sent under a salt spelled like that model's name (vLLM #44701: the
adapter's name keyed where the tenant salt goes), and the cross answer is judged against the
viewer's own cold answer to the same prompt (a fresh salt) — never against the other model's
answer: different adapters answer differently, and that is no finding.

Judged by usage.cached_tokens where the server reports it, else by TTFT over timing rounds
(Mann–Whitney U with effect size, as the timing suite judges tenants):

- shared across models: the viewer was served more cached tokens of the other model's prefix
  than of a fresh prompt (or its TTFT there is clearly below cold and like its own hits);
- isolated: it was not, in both directions, and both models' own prefixes do hit;
- inconclusive: a model's own prefix does not hit (caching off, or not reported or measurable),
  so a miss across models proves nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvpage.audit.capabilities import Capabilities
from kvpage.audit.classify import CLEAN, DRIFT_ONLY, FAILED, INCONCLUSIVE, ISOLATION, SERVER_ERRORS
from kvpage.audit.compare import first_divergence
from kvpage.audit.completion import Completion
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import BudgetExhausted
from kvpage.audit.model_pairs import UNKNOWN, ModelPair, PairPlan, plan_pairs
from kvpage.audit.probes import Prompt
from kvpage.audit.session import Tenant
from kvpage.audit.stats import mann_whitney
from kvpage.audit.suites.base import UNTESTABLE, Check, SuiteContext, SuiteResult
from kvpage.audit.suites.timing import ISOLATED, cross_hits_by_time, faster, fit_length

NAME = "models"
SHARED_MODELS = "shared across models"
NOT_APPLICABLE = "not applicable"  # one model listed: nothing to keep apart
TAIL_TOKENS = 8
MAX_TIMED_PAIRS = 2  # a timed pair costs 2 x timing_trials rounds of 5 long prompts
ARMS = ("cold", "same", "cross")
SALTED = "salted"  # the other model's prefix under cache_salt = the other model's name


@dataclass(slots=True)
class Direction:
    """One model's prefix (owner) as another model sees it (viewer), over the rounds."""

    owner: str
    viewer: str
    arms: dict[str, list[Completion]] = field(
        default_factory=lambda: {a: [] for a in (*ARMS, SALTED)}
    )


# --- the plan (also the budget planner's estimate) -------------------------------------------
def by_counts(cfg: AuditConfig, caps: Capabilities) -> bool:
    """Judged by reported cached tokens (else by TTFT)."""
    return caps.cached_tokens and cfg.trust_usage


def plan(cfg: AuditConfig, caps: Capabilities) -> PairPlan:
    cap = cfg.model_pairs if by_counts(cfg, caps) else min(cfg.model_pairs, MAX_TIMED_PAIRS)
    return plan_pairs(caps.model_cards, cfg.model, cap)


def requests(cfg: AuditConfig, caps: Capabilities, cold_refs: bool) -> int:
    """What the suite will send: per pair a round of two warms and six arms; with separating
    salts, two cold references (and, where counts decide, the salted arms and their warms), and
    one more answer where the cards do not relate the two models; where TTFT decides, the timed
    rounds too."""
    pairs = plan(cfg, caps).pairs
    if not pairs:
        return 0
    unknown = sum(1 for p in pairs if p.relation == UNKNOWN) if cold_refs else 0
    if by_counts(cfg, caps):  # with salts: two more warms, two salted arms, two references
        return len(pairs) * (8 + (6 if cold_refs else 0)) + unknown
    judged = 10 if cold_refs else 0  # timed rounds: one direction each, two warms, three arms
    return 1 + len(pairs) * (cfg.timing_trials * 10 + judged) + unknown


def plan_note(cfg: AuditConfig, caps: Capabilities) -> str:
    """What the capabilities and plan say of this suite: whether it runs, and how, or why not."""
    found = plan(cfg, caps)
    if found.skipped:
        return f"models: skipped: {found.skipped}"
    how = "cached tokens" if by_counts(cfg, caps) else "TTFT (no cached tokens used)"
    pairs = ", ".join(f"{p.first}/{p.second}" for p in found.pairs)
    listed = len(caps.models)
    return f"models: {len(found.pairs)} pair(s) of the {listed} listed probed by {how}: {pairs}"


# --- the suite -------------------------------------------------------------------------------
def run(ctx: SuiteContext) -> SuiteResult:
    result = ctx.start(NAME, UNTESTABLE)
    counts = by_counts(ctx.cfg, ctx.caps)
    found = plan(ctx.cfg, ctx.caps)
    result.data = {
        "method": "cached tokens" if counts else "timing",
        "models": list(ctx.caps.models),
        "notes": found.notes,
        "pairs": [],
    }
    if found.skipped:
        result.verdict, result.summary = NOT_APPLICABLE, f"skipped: {found.skipped}"
        result.untested.append(f"skipped: {found.skipped}")
        return result
    if found.left_out:
        result.untested.append(found.left_out)
    if not ctx.cold_refs:
        result.untested.append(
            f"answers across models are not judged against a cold answer ({ctx.no_cold}); "
            "cached tokens or timing alone decide"
        )
    length = _length(ctx, result, counts, found.pairs[0])
    if length is None:
        return result
    result.data["prefix_tokens"] = length
    rng = random.Random((ctx.cfg.seed or 0) + 211)
    try:
        for pair in found.pairs:
            scenario = f"{pair.first}/{pair.second}"
            ctx.attempt(result, scenario, lambda p=pair: _pair(ctx, result, p, length, rng))
    except BudgetExhausted as err:
        result.untested.append(f"stopped part-way: {err}")
        _finish(ctx, result, partial=True)
        return result
    _finish(ctx, result, partial=False)
    return result


def _length(ctx: SuiteContext, result: SuiteResult, counts: bool, first: ModelPair) -> int | None:
    """A few blocks where cached tokens are counted; where TTFT decides, the longest prefix the
    server accepts (from --timing-prefix-tokens, halving), so a hit shows in time."""
    if counts:
        return 4 * max(ctx.cfg.block_sizes)
    return fit_length(ctx, _as(ctx, first.second), result)


def _as(ctx: SuiteContext, model: str, salt: str | None = None) -> Tenant:
    return Tenant(model, ctx.cfg.api_key, salt, model)


def _pair(
    ctx: SuiteContext, result: SuiteResult, pair: ModelPair, length: int, rng: random.Random
) -> None:
    """A judged round (cold references: fresh salts), then timed rounds where TTFT decides. The
    pair's row is recorded only when all of its requests succeeded."""
    counts = by_counts(ctx.cfg, ctx.caps)
    checks_before = len(result.checks)
    judged = _directions(pair)
    alike = None
    if ctx.cold_refs:
        alike = _round(ctx, result, pair, judged, length, rng, timed=False, salted=counts)
    elif counts:
        _round(ctx, result, pair, judged, length, rng, timed=False, salted=False)
    timed = judged
    if not counts:  # the judged round's arms are not streamed: never mixed with timed ones
        timed = _directions(pair)
        for _ in range(ctx.cfg.timing_trials):  # one direction a round: fewer prefixes held
            for d in timed:
                _round(ctx, result, pair, [d], length, rng, timed=True, salted=False)
    row = _row(ctx, pair, timed, counts, alike)
    _checked(row, result.checks[checks_before:])
    result.data["pairs"].append(row)


def _directions(pair: ModelPair) -> list[Direction]:
    return [Direction(pair.first, pair.second), Direction(pair.second, pair.first)]


def _round(
    ctx: SuiteContext,
    result: SuiteResult,
    pair: ModelPair,
    dirs: list[Direction],
    length: int,
    rng: random.Random,
    timed: bool,
    salted: bool,
) -> bool | None:
    """Both models cache a fresh prefix (owners one more for the salted arm: no prefix reaches
    a viewer twice, so a hit can only come from the owner's cache); the arms of `dirs` follow
    in a random order. Judged (untimed, with separating salts): each cross answer against
    the viewer's cold answer to the same prompt, sent last (before it, a salt the viewer ignored
    would have made the cross arm hit the viewer's own reference). Returns, for a pair the cards
    do not relate, whether both models answer that prompt alike."""
    heads = {m: ctx.factory.random(length) for m in (pair.first, pair.second)}
    others = {d.owner: ctx.factory.random(length) for d in dirs} if salted else {}
    tails = {d.viewer: ctx.factory.random(TAIL_TOKENS) for d in dirs}
    for owner, head in [*heads.items(), *others.items()]:
        _send(ctx, head + ctx.factory.random(TAIL_TOKENS), _as(ctx, owner), timed, 1)
    judge = not timed and ctx.cold_refs
    order = [(d, arm) for d in dirs for arm in (*ARMS, *((SALTED,) if salted else ()))]
    rng.shuffle(order)
    got = [
        (d, arm, _arm(ctx, d, arm, heads, others, tails, length, timed, judge)) for d, arm in order
    ]
    for d, arm, out in got:  # a round counts only whole
        d.arms[arm].append(out)
    if not judge:
        return None
    refs = {d.viewer: _cold_answer(ctx, d.viewer, heads[d.owner] + tails[d.viewer]) for d in dirs}
    for d in dirs:
        result.checks.append(_judge(ctx, d, refs[d.viewer], d.arms["cross"][-1], length))
    return _alike(ctx, dirs[0], heads, tails, refs) if pair.relation == UNKNOWN else None


def _cold_answer(ctx: SuiteContext, model: str, prompt: Prompt) -> Completion:
    """Under a fresh salt (only where salts separate caches): nothing can be cached for it."""
    return ctx.session.complete(prompt, tenant=_as(ctx, model, ctx.factory.salt()))


def _alike(ctx: SuiteContext, d: Direction, heads: dict, tails: dict, refs: dict) -> bool:
    """Does the owner answer the viewer's reference prompt as the viewer does (both cold)? Two
    names the cards do not relate, answering alike, may be one model (which may share)."""
    prompt = heads[d.owner] + tails[d.viewer]
    other = _cold_answer(ctx, d.owner, prompt)
    return first_divergence(refs[d.viewer], other, ctx.cfg.tolerances.exact) is None


def _send(
    ctx: SuiteContext, prompt: Prompt, tenant: Tenant, timed: bool, tokens: int
) -> Completion:
    if timed:
        return ctx.session.first_token(prompt, tenant)
    return ctx.session.complete(prompt, tokens, tenant)


def _arm(
    ctx: SuiteContext,
    d: Direction,
    arm: str,
    heads: dict[str, Prompt],
    others: dict[str, Prompt],
    tails: dict[str, Prompt],
    length: int,
    timed: bool,
    judge: bool,
) -> Completion:
    """One arm under the viewer: a fresh prefix, its own, the owner's (under a salt spelled
    like the owner's name, for SALTED); every prompt ends in a fresh tail, except the judged
    cross prompt, which is the cold reference's."""
    viewer, fresh = _as(ctx, d.viewer), ctx.factory.random(TAIL_TOKENS)
    if arm == "cold":
        return _send(ctx, ctx.factory.random(length) + fresh, viewer, timed, 1)
    if arm == "same":
        return _send(ctx, heads[d.viewer] + fresh, viewer, timed, 1)
    if arm == SALTED:
        return _send(ctx, others[d.owner] + fresh, _as(ctx, d.viewer, d.owner), timed, 1)
    tokens = ctx.cfg.max_tokens if judge else 1  # the cross answer, judged in full
    return _send(ctx, heads[d.owner] + tails[d.viewer], viewer, timed, tokens)


def _judge(
    ctx: SuiteContext, d: Direction, ref: Completion, cand: Completion, length: int
) -> Check:
    context = {
        "mode": f"cached under {d.owner!r}, sent under {d.viewer!r}",
        "shared_tokens": length,
        "models": [d.owner, d.viewer],
    }
    check = ctx.judge(NAME, f"{d.owner}->{d.viewer}", ref, cand, context)
    cold = d.arms["cold"][-1]
    if check.divergence is not None and by_counts(ctx.cfg, ctx.caps) and _above([cand], [cold]):
        check.klass = ISOLATION
        check.reason = (
            f"{d.viewer!r} was served {cand.cached_tokens} cached tokens of a prefix cached only "
            f"under {d.owner!r}, and its answer changed"
        )
    return check


# --- verdicts ---------------------------------------------------------------------------------
def _above(outs: list[Completion], cold: list[Completion]) -> bool:
    """Served more cached tokens than any fresh prompt of the same model was (a chat template
    or BOS may be cached for everyone: that much is no finding)."""
    floor = [c.cached_tokens for c in cold]
    if not outs or None in floor or not floor:
        return False
    return any(o.cached_tokens is not None and o.cached_tokens > max(floor) for o in outs)


def _own_hits(d: Direction) -> bool:
    """The viewer's own prefix hits in every round: its caching works and is reported."""
    same, cold = d.arms["same"], d.arms["cold"]
    return bool(same) and all(_above([s], cold) for s in same)


def _by_counts(d: Direction) -> dict[str, Any]:
    cached = {arm: [c.cached_tokens for c in outs] for arm, outs in d.arms.items() if outs}
    out: dict[str, Any] = {"owner": d.owner, "viewer": d.viewer, "cached_tokens": cached}
    cross, salted = _above(d.arms["cross"], d.arms["cold"]), _above(d.arms[SALTED], d.arms["cold"])
    floor = max((c or 0) for c in cached["cold"]) if None not in cached["cold"] else None
    if cross:
        out["shared"] = (
            f"{d.viewer!r} was served {max(cached['cross'])} cached tokens of a prefix cached only "
            f"under {d.owner!r} (a fresh prompt under {d.viewer!r}: {floor})"
        )
    elif salted:
        out["shared"] = (
            f"{d.viewer!r} under cache_salt {d.owner!r} was served {max(cached[SALTED])} cached "
            f"tokens of a prefix cached under the model {d.owner!r}: the model's name is keyed "
            "like a tenant's salt"
        )
    out["own_hits"] = _own_hits(d)
    out["apart"] = True  # by counts, no hit is the whole evidence once the controls hit
    return out


def _by_time(d: Direction, alpha: float) -> dict[str, Any]:
    ttft = {arm: [c.ttft_s or 0.0 for c in d.arms[arm]] for arm in ARMS}
    tests = {
        "same_vs_cold": mann_whitney(ttft["same"], ttft["cold"]),
        "cross_vs_cold": mann_whitney(ttft["cross"], ttft["cold"]),
        "cross_vs_same": mann_whitney(ttft["cross"], ttft["same"], "greater"),
    }
    shown = {name: t.to_json() for name, t in tests.items()}
    own = faster(shown["same_vs_cold"], alpha)
    out: dict[str, Any] = {"owner": d.owner, "viewer": d.viewer, "ttft_s": ttft, "tests": shown}
    if cross_hits_by_time(shown, alpha, own):
        t = shown["cross_vs_cold"]
        out["shared"] = (
            f"{d.viewer!r}'s TTFT on a prefix cached only under {d.owner!r} is below cold "
            f"(p={t['p']:.2g}, effect {t['effect']:.2f}) and like its own cache hits"
        )
    out["own_hits"] = own
    out["apart"] = shown["cross_vs_same"]["p"] < alpha  # clearly slower than its own hits
    return out


def _row(
    ctx: SuiteContext, pair: ModelPair, dirs: list[Direction], counts: bool, alike: bool | None
) -> dict[str, Any]:
    judged = [_by_counts(d) if counts else _by_time(d, ctx.cfg.alpha) for d in dirs]
    row: dict[str, Any] = {**pair.to_json(), "directions": judged, "answers_alike": alike}
    shared = [j["shared"] for j in judged if "shared" in j]
    if shared and pair.relation == UNKNOWN and alike is not False:
        seen = "they answer alike" if alike else "their answers were not compared"
        row["verdict"], row["reason"] = (
            INCONCLUSIVE,
            (
                f"{shared[0]}; but the cards name neither root nor parent and {seen}: they may be "
                "two names of one model, which may share its cache"
            ),
        )
    elif shared:
        row["verdict"], row["reason"] = SHARED_MODELS, "; ".join(shared)
    elif all(j["own_hits"] and j["apart"] for j in judged):
        row["verdict"] = ISOLATED
        row["reason"] = "neither model was served the other's cached prefix; both hit their own"
    else:
        row["verdict"], row["reason"] = INCONCLUSIVE, _why_inconclusive(judged, counts)
    return row


def _why_inconclusive(judged: list[dict[str, Any]], counts: bool) -> str:
    missing = [j["viewer"] for j in judged if not j["own_hits"]]
    if missing:
        how = "more cached tokens than a fresh prompt" if counts else "a TTFT below cold"
        return (
            f"a prefix cached under {missing[0]!r} showed no reuse under {missing[0]!r} itself "
            f"({how} expected): caching is off or not measurable, so a miss across models "
            "proves nothing"
        )
    return (
        "the prefix of the other model is timed neither like a hit nor clearly slower than the "
        "model's own hits: nothing is proven"
    )


def _checked(row: dict[str, Any], checks: list[Check]) -> None:
    """A cross answer that changed beyond numeric drift is an isolation failure of the pair."""
    bad = [c for c in checks if c.klass == ISOLATION]
    if bad:
        row["verdict"] = FAILED
        row["reason"] = f"{bad[0].name}: {bad[0].reason}; {row['reason']}"


def _finish(ctx: SuiteContext, result: SuiteResult, partial: bool) -> None:
    rows = result.data["pairs"]
    verdicts = {r["verdict"] for r in rows}
    judged = result.judged_verdict()
    if judged == FAILED or FAILED in verdicts:
        verdict = FAILED
    elif SHARED_MODELS in verdicts:
        verdict = SHARED_MODELS
    elif result.server_errors:
        verdict = SERVER_ERRORS
    elif not rows:
        verdict = UNTESTABLE
    elif verdicts == {ISOLATED} and judged in (CLEAN, DRIFT_ONLY):
        verdict = ISOLATED
    else:
        verdict = INCONCLUSIVE
    if partial and verdict not in (FAILED, SHARED_MODELS, UNTESTABLE):
        verdict = f"{verdict} (partial)"
    result.verdict = verdict
    result.summary = _summary(result, rows)


def _summary(result: SuiteResult, rows: list[dict[str, Any]]) -> str:
    tally: dict[str, int] = {}
    for r in rows:
        tally[r["verdict"]] = tally.get(r["verdict"], 0) + 1
    counts = ", ".join(f"{n} {v}" for v, n in tally.items()) or "none judged"
    text = (
        f"{len(rows)} pair(s) of models by {result.data['method']}: {counts}; "
        f"{len(result.checks)} cross answers judged against the model's own cold answer, "
        f"{len(result.divergences)} diverged"
    )
    worst = next((r for r in rows if r["verdict"] != ISOLATED), None)
    if worst is not None:
        text += f"; {'/'.join(worst['models'])}: {worst['reason']}"
    return text
