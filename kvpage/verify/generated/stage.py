"""The generated stage of the gate: scenarios from one seed, run in order as ordinary cases
until the count or the time budget is reached; a failing scenario is shrunk and written as a
replayable JSON file. The same (seed, index) is the same scenario on every machine, so a run
is reproducible up to how many scenarios the budget allowed, which the report states."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.verify.generated.coverage import coverage_table
from kvpage.verify.generated.generator import Limits, generate
from kvpage.verify.generated.scenario import Scenario, to_case
from kvpage.verify.generated.shrink import shrink
from kvpage.verify.suites import CaseResult, Runtime, run_case

DEFAULT_SEED = 0


@dataclass(slots=True)
class GeneratedStage:
    """How many scenarios, from which seed, within what time (None: no bound of that kind)."""

    seed: int = DEFAULT_SEED
    count: int | None = None
    budget_s: float | None = None
    shrink_budget_s: float = 60.0
    limits: Limits = field(default_factory=Limits)
    fixed: dict = field(default_factory=dict)  # engine fields every scenario keeps (FIXABLE)

    def scenarios(
        self, windows: tuple[int, ...] = (), adapters: bool = True, constraints: bool = True
    ):
        """`windows`: the model's sliding windows, `adapters`: whether it is served adapters,
        `constraints`: whether requests may be constrained (the model has a tokenizer)
        (generate's)."""
        index = 0
        while self.count is None or index < self.count:
            yield generate(
                self.seed, index, self.limits, self.fixed, windows, adapters, constraints
            )
            index += 1


@dataclass(slots=True)
class GeneratedResult:
    seed: int
    results: list[CaseResult]
    scenarios: list[Scenario]
    seconds: float
    reproducers: list[str] = field(default_factory=list)  # files written for failures
    stopped_by: str = "count"  # count | time budget

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "scenarios": len(self.results),
            "failures": sum(not r.passed for r in self.results),
            "seconds": round(self.seconds, 2),
            "stopped_by": self.stopped_by,
            "coverage": coverage_table(self.scenarios),
            "reproducers": self.reproducers,
            "failed": [
                {"case": r.case, "failures": [f.to_dict() for f in r.failures[:3]]}
                for r in self.results
                if not r.passed
            ],
        }


def run_stage(
    stage: GeneratedStage,
    runtime: Runtime,
    report_dir: str | Path | None = None,
    on_scenario=None,
) -> GeneratedResult:
    """Every scenario of `stage` against `runtime`'s engine; failures shrunk and written under
    `report_dir`/reproducers (when given)."""
    start = time.perf_counter()
    results, ran, stopped_by = [], [], "count"
    config = runtime.model.config
    drawn = stage.scenarios(
        model_windows(config), serves_adapters(config), runtime.tokenizer is not None
    )
    for scenario in drawn:
        if stage.budget_s is not None and time.perf_counter() - start > stage.budget_s:
            stopped_by = "time budget"
            break
        result = run_scenario(scenario, runtime)
        results.append(result)
        ran.append(scenario)
        if on_scenario is not None:
            on_scenario(scenario, result)
    out = GeneratedResult(stage.seed, results, ran, time.perf_counter() - start, [], stopped_by)
    if report_dir is not None:
        for scenario, result in zip(ran, results, strict=True):
            if not result.passed:
                small = reproducer(scenario, result, runtime, stage.shrink_budget_s)
                path = Path(report_dir) / "reproducers" / f"{scenario.name}.json"
                out.reproducers.append(str(small.write(path)))
    return out


def model_windows(config) -> tuple[int, ...]:
    """The distinct sliding windows of a model's layers (none for a global-only model)."""
    return tuple(sorted({w for w in config.layer_windows or () if w is not None}))


def serves_adapters(config) -> bool:
    """The engine serves LoRA adapters on Llama-shaped models (it refuses them on GPT-2, and
    on int8 weights, which `generate` reads from the fixed fields)."""
    return config.model_type in ("llama", "gemma3")


def run_scenario(scenario: Scenario, runtime: Runtime) -> CaseResult:
    return run_case(to_case(scenario, runtime.model), runtime)


def failure_signature(result: CaseResult) -> tuple[str, str | None]:
    """What "fails the same way" means to the shrinker: the first failure's kind and class."""
    first = result.failures[0]
    div = result.first_divergence
    if div is None:
        return first.kind, None
    # a kernel's re-attribution keeps what the divergence read as before it (what a run
    # without the re-runs reports)
    return first.kind, div.attribution.fields.get("class_before", div.attribution.cls)


def reproducer(scenario: Scenario, result: CaseResult, runtime: Runtime, budget_s: float):
    """`scenario` shrunk while it keeps failing with `result`'s signature."""
    want = failure_signature(result)

    def fails(candidate: Scenario) -> bool:
        runtime.kernel_reruns = False  # whether it fails, not which kernel: no re-runs
        try:
            again = run_scenario(candidate, runtime)
        finally:
            runtime.kernel_reruns = True
        return not again.passed and failure_signature(again) == want

    small, _ = shrink(scenario, fails, budget_s)
    return small
