"""The gate's entry points to the whole-stack suite: run it on a model, or run it against one
server or router mutant and say whether it was caught and with which attribution class."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvpage.verify.stack.mutants import STACK_MUTANTS, StackMutant
from kvpage.verify.stack.router_model import router_cases
from kvpage.verify.stack.server_suite import server_cases
from kvpage.verify.stack.text_oracle import text_model
from kvpage.verify.suites import CaseResult

DEFAULT_SEED = 0
DEFAULT_BUDGET_S = 20.0


def run_server_suite(
    model,
    tokenizer,
    model_name: str,
    seed: int = DEFAULT_SEED,
    budget_s: float = DEFAULT_BUDGET_S,
) -> list[CaseResult]:
    """The server cases (two apps) then the router cases. Past `budget_s` the remaining
    generated requests are skipped (each case's `requests` says how many ran); the router
    cases take well under a second and always run. A model without a tokenizer (no text to
    judge) gets the router cases only."""
    deadline = time.perf_counter() + budget_s
    router = router_cases(seed)
    if tokenizer is None or text_model(model_name, tokenizer) is None:
        return router
    return server_cases(model, tokenizer, model_name, seed, deadline) + router


@dataclass(slots=True)
class StackMutantResult:
    """Like the gate's MutantResult: `divergence` is Divergence.to_dict() of the first one."""

    mutant: StackMutant
    caught: bool
    caught_by: list[str]
    first_failure: str | None
    divergence: dict | None
    seconds: float
    cases: list[CaseResult] = field(default_factory=list)
    not_applicable: str | None = None  # as the gate's MutantResult: why it cannot show here

    @property
    def attributed_class(self) -> str | None:
        return None if self.divergence is None else self.divergence["attribution"]["class"]

    @property
    def attribution_ok(self) -> bool:
        return (
            self.divergence is not None
            and self.attributed_class == self.mutant.expected_class
            and not self.divergence["attribution"]["missing"]
        )


def run_server_mutant(
    mutant: StackMutant,
    model,
    tokenizer,
    model_name: str,
    seed: int = DEFAULT_SEED,
    budget_s: float = DEFAULT_BUDGET_S,
) -> StackMutantResult:
    """The suite of the mutant's layer with the mutant planted in every app (or router) it
    builds, until the first case that fails."""
    start = time.perf_counter()
    if mutant.not_applicable is not None:
        why = mutant.not_applicable(text_model(model_name, tokenizer))
        if why is not None:
            return StackMutantResult(mutant, False, [], None, None, 0.0, [], why)
    if mutant.layer == "server":
        deadline = start + budget_s
        cases = server_cases(model, tokenizer, model_name, seed, deadline, mutant.apply, True)
    else:
        cases = router_cases(seed, mutant.apply)
    failed = [c for c in cases if not c.passed]
    first = failed[0] if failed else None
    divergence = first.first_divergence if first else None
    return StackMutantResult(
        mutant,
        bool(failed),
        [c.case for c in failed],
        f"{first.case}: {first.failures[0].message}" if first else None,
        None if divergence is None else divergence.to_dict(),
        time.perf_counter() - start,
        cases,
    )


__all__ = [
    "STACK_MUTANTS",
    "StackMutant",
    "StackMutantResult",
    "run_server_mutant",
    "run_server_suite",
]
