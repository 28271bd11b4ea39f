"""The generality figure: every mutant against the generated scenarios alone, hand-written
cases switched off. A mutant counts as caught when some scenario the honest engine passed fails
against it; its attribution is reported too (a generated scenario does many things at once, so
the first divergence may be named by a neighbouring class: the hand-written mutation check is
the one that demands the exact class)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
        """Every field but the mutant's name (the report's key for it)."""
        out = asdict(self)
        del out["mutant"]
        return out | {"seconds": round(self.seconds, 2)}


# The coverage dimensions that exercise what a suite's mutants break: a mutant's scenarios run
# those first (only the order, and so the time, depends on it; any scenario may catch it), as
# the gate's mutation check runs a mutant's own suites first.
SUITE_DIMENSIONS: dict[str, tuple[str, ...]] = {
    "lora": ("lora_adapters",),
    "prompt_logprobs": ("prompt_rows", "prompt_logprobs"),
    "policy": ("eviction_order", "siblings"),
    "namespaces": ("off_window",),
    "sampling": ("seeded_recompute",),
    "structured": ("structured",),
}


def focus_order(mutant, scenarios: list) -> list:
    """`scenarios` with those covering one of the mutant's suites' dimensions first."""
    dims = [d for suite in mutant.suites for d in SUITE_DIMENSIONS.get(suite, ())]
    first = [s for s in scenarios if any(d in s.covers for d in dims)]
    return first + [s for s in scenarios if not any(d in s.covers for d in dims)]


def generated_alone(mutants, model, tokenizer, model_name, generated, runtime, run_mutant):
    """Each mutant (not-applicable ones left out) against the scenarios of `generated` the
    honest engine passed, its suites' scenarios first; `run_mutant` is the gate's, given one
    scenario at a time, so a mutant stops at the first scenario with any failure."""
    passed = [s for s, r in zip(generated.scenarios, generated.results, strict=True) if r.passed]
    out = []
    for mutant in mutants:
        if mutant.not_applicable(model.config) is not None:
            continue
        if mutant.needs_tokenizer and tokenizer is None:  # no scenario draws a constraint
            continue
        seconds, found = 0.0, None
        for scenario in focus_order(mutant, passed):
            case = to_case(scenario, model)  # a case from to_case serves one run
            r = run_mutant(mutant, model, tokenizer, model_name, [case], runtime)
            seconds += r.seconds
            if r.caught:
                found = r
                break
        out.append(
            AloneResult(
                mutant.name,
                found is not None,
                found.caught_by[0] if found is not None else None,
                None if found is None else found.attributed_class,
                mutant.expected_class,
                seconds,
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
