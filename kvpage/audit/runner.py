"""One audit, end to end: probe capabilities, fit the plan to the budget, run the suites, and
decide the exit status (0 isolated, 1 isolation failure or a leak across tenants or models)."""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvpage.audit.accounting import Anomaly
from kvpage.audit.capabilities import Capabilities, Prober
from kvpage.audit.classify import FAILED, SERVER_ERRORS, SERVER_FAILED
from kvpage.audit.client import AuditClient, Budget
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import AuditUsageError, BudgetExhausted, ServerUnreachable
from kvpage.audit.findings import findings
from kvpage.audit.plan import estimate, fit
from kvpage.audit.probes import PromptFactory
from kvpage.audit.session import AuditSession
from kvpage.audit.stats import block_size_from_cached
from kvpage.audit.suites import RUNNERS, SuiteContext, SuiteResult, models
from kvpage.audit.suites import reference as reference_suite
from kvpage.audit.suites.base import UNTESTABLE
from kvpage.audit.suites.models import NOT_APPLICABLE, SHARED_MODELS
from kvpage.audit.suites.timing import SHARED

ORDER = ("baseline", "batch", "prefix", "canaries", "timing", "models")


@dataclass(slots=True)
class AuditResult:
    cfg: AuditConfig
    caps: Capabilities
    suites: list[SuiteResult]
    plan_notes: list[str] = field(default_factory=list)
    requests: int = 0
    wall_s: float = 0.0
    retries: list[dict[str, Any]] = field(default_factory=list)  # resent on a fresh connection
    failure: dict[str, Any] | None = None  # the server stopped answering: where, after what
    anomalies: list[Anomaly] = field(default_factory=list)  # phantom cache hits (accounting.py)

    @property
    def failed(self) -> bool:
        bad = (FAILED, SHARED, SHARED_MODELS, SERVER_ERRORS, SERVER_FAILED)
        return bool(self.anomalies) or any(s.verdict in bad for s in self.suites)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    @property
    def verdict(self) -> str:
        """The worst finding names it: isolation, then a server failing under sharing, then
        phantom cache hits."""
        verdicts = {s.verdict for s in self.suites}
        if verdicts & {FAILED, SHARED, SHARED_MODELS}:
            return "NOT ISOLATED"
        if self.failure is not None or verdicts & {SERVER_ERRORS, SERVER_FAILED}:
            return "SERVER FAILED UNDER CACHE SHARING"
        if self.anomalies:
            return "CACHE ACCOUNTING ANOMALY"
        if all(s.verdict in (UNTESTABLE, NOT_APPLICABLE) for s in self.suites):
            return "NOTHING TESTABLE"
        incomplete = [
            s.name for s in self.suites if s.verdict == UNTESTABLE or "partial" in s.verdict
        ]
        if incomplete:
            return f"no isolation failure found (incomplete: {', '.join(incomplete)})"
        return "isolated (no isolation failure found)"

    def block_size(self) -> int | None:
        """The caching granularity implied by every cached-token count the audit saw."""
        counts = [
            c.cand.cached_tokens
            for s in self.suites
            if s.name == "prefix"
            for c in s.checks
            if c.cand.cached_tokens is not None
        ]
        counts += [
            r["warm_cached_tokens"] or 0 for s in self.suites for r in s.data.get("shares", [])
        ]
        return block_size_from_cached(counts)

    def to_json(self) -> dict[str, Any]:
        data = self._data()
        data["findings"] = findings(data)
        return data

    def _data(self) -> dict[str, Any]:
        return {
            "server": self.cfg.root,
            "model": self.cfg.model,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "requests": self.requests,
            "budget_requests": self.cfg.budget_requests,
            "wall_s": round(self.wall_s, 3),
            "seed": self.cfg.seed,
            "inferred_block_size": self.block_size(),
            "retries": len(self.retries),
            "retried_requests": self.retries,
            "server_failure": self.failure,
            "accounting_anomalies": [a.to_json() for a in self.anomalies],
            "capabilities": self.caps.to_json(),
            "plan_notes": self.plan_notes,
            "suites": {s.name: s.to_json() for s in self.suites},
        }


class Progress:
    """On a terminal, one line on stderr redrawn per request (requests used of the budget,
    current suite); elsewhere (a log, a pipe) one line per suite."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.suite = enabled, "capabilities"
        self.tty = enabled and sys.stderr.isatty()

    def start(self, suite: str, budget: Budget) -> None:
        self.suite = suite
        if self.enabled and not self.tty:
            print(f"audit: {suite} ({budget.used}/{budget.limit} requests so far)", file=sys.stderr)

    def __call__(self, used: int, limit: int) -> None:
        if not self.tty:
            return
        width = 30
        done = min(width, width * used // max(limit, 1))
        bar = "#" * done + "-" * (width - done)
        print(
            f"\raudit [{bar}] {used}/{limit} requests  {self.suite:<12}",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def run_audit(cfg: AuditConfig) -> AuditResult:
    start = time.perf_counter()
    if cfg.seed is None:  # fresh prompts and salts for every run (reported, to reproduce it)
        cfg = replace(cfg, seed=secrets.randbits(32))
    reference = _reference(cfg)
    progress = Progress(cfg.progress)
    budget = Budget(cfg.budget_requests, progress)
    try:
        with AuditClient(cfg, budget) as client:
            caps = _probe(cfg, client)
            cold_refs = caps.cache_salt and not caps.salt_ignored
            client.accounting.separate_salts = cold_refs
            planned, notes = fit(cfg, budget.remaining, cold_refs, caps)
            if "models" in planned.suites:  # whether the probe across models runs, or why not
                notes.append(models.plan_note(planned, caps))
            factory = PromptFactory(cfg.seed or 0, caps.id_range, caps.chars_per_token)
            ctx = SuiteContext(planned, caps, AuditSession(planned, client, caps), factory)
            shares = _shares(estimate(planned, cold_refs, caps), budget.remaining)
            results, failure = _run_suites(ctx, progress, budget, shares)
            if reference is not None:
                progress.start("reference", budget)
                results.append(reference_suite.run(ctx, results, reference))
    finally:
        progress.close()
    result = AuditResult(cfg, caps, results, notes, budget.used, time.perf_counter() - start)
    result.retries, result.failure = list(client.retries), failure
    result.anomalies = list(client.accounting.anomalies)
    cold_refs = caps.cache_salt and not caps.salt_ignored
    costs = estimate(planned, cold_refs, caps)
    result.plan_notes.append(f"planned requests per suite: {costs}")
    return result


def _reference(cfg: AuditConfig):
    """The reference model, loaded before any request (torch is imported only for it)."""
    if cfg.reference_model is None:
        return None
    from kvpage.audit.reference import load

    return load(cfg.reference_model, cfg.reference_dtype)


def _probe(cfg: AuditConfig, client: AuditClient) -> Capabilities:
    try:
        return Prober(cfg, client).run()
    except BudgetExhausted as err:
        raise AuditUsageError(
            f"--budget-requests {cfg.budget_requests} is spent before the server's capabilities "
            "are known (about 15 requests): nothing could be audited"
        ) from err


def _shares(costs: dict[str, int], remaining: int) -> dict[str, int] | None:
    """Per-suite request caps when the plan does not fit (None: it fits, no caps). The baseline
    and batch suites are cheap and the others are judged against them: they get what they
    need; the rest is split in proportion, so a tight budget shortens every later suite
    instead of starving the last ones."""
    if sum(costs.values()) <= remaining:
        return None
    first = {n: min(costs[n], remaining) for n in ("baseline", "batch") if n in costs}
    left = max(0, remaining - sum(first.values()))
    rest = {n: c for n, c in costs.items() if n not in first}
    total = sum(rest.values()) or 1
    return {**first, **{n: left * c // total for n, c in rest.items()}}


def _run_suites(
    ctx: SuiteContext, progress: Progress, budget: Budget, shares: dict[str, int] | None
) -> tuple[list[SuiteResult], dict[str, Any] | None]:
    """The suites in order. A server that stops answering ends its suite as a finding; if it is
    still down, the suites after it are not run (and say so)."""
    wanted = set(ctx.cfg.suites) | ({"baseline"} if "batch" in ctx.cfg.suites else set())
    results: list[SuiteResult] = []
    failure: dict[str, Any] | None = None
    for name in (n for n in ORDER if n in wanted):
        if failure is not None and not failure["alive_after"]:
            results.append(_not_run(name, failure))
            continue
        progress.start(name, budget)
        ctx.session.client.accounting.phase = name
        budget.stop_at = None if shares is None else budget.used + shares[name]
        try:
            results.append(RUNNERS[name](ctx))
        except BudgetExhausted as err:
            results.append(_partial(ctx, name, err))
        except ServerUnreachable as err:
            budget.stop_at = None
            result, latest = _server_failed(ctx, name, err)
            latest["earlier"] = failure  # a server that came back and failed again: both
            failure = latest
            results.append(result)
    budget.stop_at = None
    return results, failure


def _server_failed(
    ctx: SuiteContext, name: str, err: ServerUnreachable
) -> tuple[SuiteResult, dict[str, Any]]:
    """The suite's checks so far, the failure as its finding, and the requests before it."""
    client = ctx.session.client
    result = ctx.current if ctx.current is not None and ctx.current.name == name else None
    result = result or SuiteResult(name, SERVER_FAILED)
    result.errors.append({"scenario": "no answer", "status": 0, "message": str(err)})
    alive = client.alive()
    failure = {
        "suite": name,
        "error": str(err),
        "alive_after": alive,
        "preceding_requests": list(client.recent),
    }
    judged = result.judged_verdict()  # an isolation failure seen before the crash stays one
    result.verdict = FAILED if judged == FAILED else SERVER_FAILED
    state = "answers again" if alive else "no longer answers"
    result.summary = (
        f"the server failed under cache sharing: no answer during {name} ({err}); it {state}; "
        f"{len(result.checks)} checks judged before"
    )
    return result, failure


def _not_run(name: str, failure: dict[str, Any]) -> SuiteResult:
    result = SuiteResult(name, UNTESTABLE, "not run: the server stopped answering")
    result.untested.append(f"not run: the server stopped answering during {failure['suite']}")
    return result


def _partial(ctx: SuiteContext, name: str, err: BudgetExhausted) -> SuiteResult:
    """What a suite judged before the budget ran out still counts; its verdict says partial."""
    result = ctx.current if ctx.current is not None and ctx.current.name == name else None
    result = result or SuiteResult(name, UNTESTABLE)
    judged = name != "timing" and (result.checks or result.errors)
    result.verdict = result.judged_verdict() if judged else UNTESTABLE
    if result.verdict != FAILED and result.verdict != UNTESTABLE:
        result.verdict = f"{result.verdict} (partial)"
    result.untested.append(f"stopped part-way: {err}")
    result.summary = result.summary or f"{len(result.checks)} checks before the budget ran out"
    return result
