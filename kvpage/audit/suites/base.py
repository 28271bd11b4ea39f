"""What every suite shares: the context it runs in, the judged comparison (`Check`) and the
suite's result. A check is one candidate output against its reference — the same prompt, alone,
and cold wherever the server lets us make it cold (a fresh cache salt)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpage.audit.capabilities import Capabilities
from kvpage.audit.classify import ISOLATION, Noise, classify, suite_verdict
from kvpage.audit.compare import Divergence, first_divergence
from kvpage.audit.completion import Completion
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import RequestRejected
from kvpage.audit.probes import Prompt, PromptFactory
from kvpage.audit.session import AuditSession, Tenant

UNTESTABLE = "untestable"
PRECEDING = 6  # requests shown before a 5xx


@dataclass(slots=True)
class Check:
    suite: str
    name: str
    context: dict[str, Any]  # what was shared or concurrent, block size, lengths
    ref: Completion
    cand: Completion
    divergence: Divergence | None = None
    klass: str | None = None  # None: no divergence
    reason: str = ""
    pair: tuple[str, str] | None = None  # (whose canary, who showed it)

    def evidence(self) -> dict[str, Any]:
        """Where the divergence sits relative to each candidate block size."""
        if self.divergence is None or self.cand.prompt_tokens is None:
            return {}
        position = self.cand.prompt_tokens + self.divergence.index
        sizes = self.context.get("block_sizes") or []
        return {
            "absolute_position": position,
            "offset_in_block": {str(b): position % b for b in sizes},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "name": self.name,
            "context": self.context,
            "class": self.klass,
            "reason": self.reason,
            "pair": list(self.pair) if self.pair else None,
            "divergence": self.divergence.to_json() if self.divergence else None,
            "evidence": self.evidence(),
            "reference": self.ref.summary(),
            "candidate": self.cand.summary(),
        }


@dataclass(slots=True)
class SuiteResult:
    name: str
    verdict: str
    summary: str = ""
    checks: list[Check] = field(default_factory=list)
    untested: list[str] = field(default_factory=list)  # what could not be tested, and why
    data: dict[str, Any] = field(default_factory=dict)  # suite-specific measurements
    errors: list[dict[str, Any]] = field(default_factory=list)  # requests the server failed

    @property
    def server_errors(self) -> int:
        return sum(1 for e in self.errors if e["status"] >= 500)

    def judged_verdict(self) -> str:
        return suite_verdict([c.klass for c in self.checks if c.klass], self.server_errors)

    @property
    def divergences(self) -> list[Check]:
        return [c for c in self.checks if c.divergence is not None]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "summary": self.summary,
            "untested": self.untested,
            "data": self.data,
            "errors": self.errors,
            "checks": [c.to_json() for c in self.checks],
        }


@dataclass(slots=True)
class SuiteContext:
    cfg: AuditConfig
    caps: Capabilities
    session: AuditSession
    factory: PromptFactory
    noise: Noise = field(default_factory=Noise)
    solo: dict[str, tuple[Prompt, Completion]] = field(default_factory=dict)  # baseline probes
    current: SuiteResult | None = None  # the running suite's result, kept if it stops part-way

    def start(self, name: str, verdict: str) -> SuiteResult:
        self.current = SuiteResult(name, verdict)
        return self.current

    @property
    def cold_refs(self) -> bool:
        """Can a reference be made cold on demand (a fresh cache salt per request)?"""
        return self.caps.cache_salt and not self.caps.salt_ignored

    @property
    def no_cold(self) -> str:
        """Why references cannot be made cold, in a few words (a report's reason)."""
        if self.caps.cache_salt and self.caps.salt_ignored:
            return "cache_salt is accepted but does not separate caches"
        return "the server takes no cache_salt"

    def cold(self) -> Tenant:
        """A tenant nobody else is: a fresh salt where the server takes salts."""
        salt = self.factory.salt() if self.cold_refs else None
        return Tenant("cold", self.cfg.api_key, salt)

    def attempt(self, result: SuiteResult, scenario: str, fn: Callable[[], None]) -> None:
        """Run one scenario; a request the server fails is recorded (and the suite goes on):
        a 5xx under sharing or concurrency is a finding, a 4xx a scenario it cannot test."""
        try:
            fn()
        except RequestRejected as err:
            error = {"scenario": scenario, "status": err.status, "message": err.message}
            if err.status >= 500:  # a finding: show what led to it
                error["preceding_requests"] = list(self.session.client.recent)[-PRECEDING:]
            result.errors.append(error)
            if err.status < 500:
                result.untested.append(f"{scenario}: refused by the server ({err})")

    def judge(
        self,
        suite: str,
        name: str,
        ref: Completion,
        cand: Completion,
        context: dict[str, Any],
        foreign_canary: str | None = None,
        pair: tuple[str, str] | None = None,
        both_cold: bool = False,
    ) -> Check:
        """Compare and classify. `both_cold`: both answers were sent under fresh cache salts,
        so neither may have been served a cached token; a divergence where one was is a hit
        across namespaces, whatever its margin."""
        context = {"block_sizes": list(self.cfg.block_sizes), **context}
        div = first_divergence(ref, cand, self.cfg.tolerances.exact)
        check = Check(suite, name, context, ref, cand, div)
        if div is None:  # identical outputs: a foreign canary would be in the reference too
            return check
        hit = max(ref.cached_tokens or 0, cand.cached_tokens or 0) if both_cold else 0
        if hit and foreign_canary is None:
            check.klass = ISOLATION
            check.reason = (
                f"served {hit} cached tokens under a fresh cache salt, and the answer changed"
            )
            return check
        phantom = next((c for c in (cand, ref) if c.phantom), None)
        if phantom is not None and foreign_canary is None:
            side = "the other answer" if phantom is cand else "the solo answer"
            check.klass = ISOLATION
            check.reason = (
                f"{side} was served {phantom.cached_tokens} cached tokens where the audit had "
                f"shared at most {phantom.shared_bound} (a phantom hit), and the answer changed"
            )
            return check
        verdict = classify(div, self.noise, self.cfg.tolerances, foreign_canary)
        check.klass, check.reason = verdict.klass, verdict.reason
        check.pair = pair if foreign_canary is not None else None
        return check
