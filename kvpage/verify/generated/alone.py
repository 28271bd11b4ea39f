"""The generality figure: every mutant against the generated scenarios alone, hand-written
cases switched off. A mutant counts as caught when some scenario the honest engine passed fails
against it; its attribution is reported too (a generated scenario does many things at once, so
the first divergence may be named by a neighbouring class: the hand-written mutation check is
the one that demands the exact class)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.verify.generated.scenario import to_case


@dataclass(slots=True)
class AloneResult:
    mutant: str
    caught: bool
    caught_by: str | None  # the scenario
    attributed_class: str | None
    expected_class: str
    seconds: float

    def to_dict(self) -> dict:
        return {
            "caught": self.caught,
            "caught_by": self.caught_by,
            "attributed_class": self.attributed_class,
            "expected_class": self.expected_class,
            "seconds": round(self.seconds, 2),
        }


def generated_alone(mutants, model, tokenizer, model_name, generated, runtime, run_mutant):
    """Each mutant (not-applicable ones left out) against the scenarios of `generated` the
    honest engine passed, in their order; `run_mutant` is the gate's (it stops at the first
    divergence)."""
    passed = [s for s, r in zip(generated.scenarios, generated.results, strict=True) if r.passed]
    out = []
    for mutant in mutants:
        if mutant.not_applicable(model.config) is not None:
            continue
        cases = [to_case(s) for s in passed]  # a case from to_case serves one run
        r = run_mutant(mutant, model, tokenizer, model_name, cases, runtime)
        out.append(
            AloneResult(
                mutant.name,
                r.caught,
                r.caught_by[0] if r.caught_by else None,
                r.attributed_class,
                mutant.expected_class,
                r.seconds,
            )
        )
    return out


def alone_summary(results: list[AloneResult]) -> dict:
    caught = sum(r.caught for r in results)
    attributed = sum(r.caught and r.attributed_class == r.expected_class for r in results)
    return {
        "mutants": len(results),
        "caught": caught,
        "score": caught / len(results) if results else None,
        "attributed_as_expected": attributed,
        "missed": [r.mutant for r in results if not r.caught],
        "per_mutant": {r.mutant: r.to_dict() for r in results},
    }
