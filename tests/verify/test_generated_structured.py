"""Generated scenarios draw constraints too: some requests get a small bounded JSON schema, regex
or choice (kvpage.verify.generated.constraints), the scenario stays replayable plain data, the
honest engine passes them with the checker applied to outputs that complete, and a structured
bug planted in the engine is caught on them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.structured_params import StructuredOutputsParams
from kvpage.verify.generated import Scenario, generate, run_scenario
from kvpage.verify.generated.constraints import KINDS
from kvpage.verify.generated.scenario import to_case
from kvpage.verify.mutants.structured import STRUCTURED_MUTANTS
from kvpage.verify.structured import check_output
from kvpage.verify.suites import Runtime

MODEL = "builtin:tiny-llama"
INDICES = range(40)


@pytest.fixture(scope="module")
def runtime():
    model, tokenizer = load_model(MODEL)
    return Runtime(model, tokenizer, MODEL)


@pytest.fixture(scope="module")
def constrained():
    """The first scenarios with a constrained request, and those requests."""
    found = []
    for index in INDICES:
        scenario = generate(0, index)
        requests = [r for r in scenario.requests if r.structured is not None]
        if requests:
            found.append((scenario, requests))
    return found


def test_scenarios_draw_every_kind_of_constraint(constrained):
    kinds = {StructuredOutputsParams(**r.structured).kind for _, rs in constrained for r in rs}
    assert kinds == set(KINDS)
    assert len(constrained) >= 10
    covered = {k for s, _ in constrained for k in s.covers["structured"]}
    assert covered == kinds
    free = sum(r.structured is None for s, _ in constrained for r in s.requests)
    assert free > 0  # constrained beside free requests


def test_a_constrained_scenario_is_replayable_plain_data(constrained):
    scenario, requests = constrained[0]
    again = Scenario.from_json(scenario.to_json())
    assert again.to_json() == scenario.to_json()
    specs = {s.request_id: s for s in to_case(again).requests}
    for r in requests:
        assert specs[r.request_id].params.structured_outputs == StructuredOutputsParams(
            **r.structured
        )


def test_the_honest_engine_passes_and_completed_outputs_are_checked(constrained, runtime):
    completed = 0
    for scenario, requests in constrained[:8]:
        result = run_scenario(scenario, runtime)
        assert result.passed, (scenario.name, [f.message for f in result.failures])
        for r in requests:
            spec = next(s for s in to_case(scenario).requests if s.request_id == r.request_id)
            if spec.stop_at_ref_step is not None:
                continue
            ref = runtime.reference(spec, scenario.engine["block_size"])
            if ref.finish_reason == "stop" and ref.records[-1].grammar["finished"]:
                text = runtime.grammars.text(ref.token_ids)
                assert check_output(spec.params.structured_outputs, text) is None
                completed += 1
    assert completed >= 3


def _mutant_runtime(base: Runtime, name: str) -> Runtime:
    mutant = next(m for m in STRUCTURED_MUTANTS if m.name == name)

    def factory(cfg: EngineConfig) -> LLMEngine:
        engine = LLMEngine(replace(cfg, **mutant.config), base.model, base.tokenizer)
        mutant.apply(engine)
        return engine

    return Runtime(base.model, base.tokenizer, MODEL, debug_checks=False, engine_factory=factory)


def test_a_structured_bug_is_caught_on_generated_scenarios(constrained, runtime):
    broken = _mutant_runtime(runtime, "grammar_termination_ignored")
    caught = []
    for scenario, _ in constrained[:8]:
        result = run_scenario(scenario, broken)
        if not result.passed:
            caught.append(result.first_divergence.attribution.cls)
    assert caught and set(caught) == {"structured"}, caught
