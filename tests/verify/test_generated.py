"""The generated stage: scenarios are reproducible plain data, they reach every value of the
dimensions they draw, the honest engine passes them, a planted bug is caught, shrunk and
written as a reproducer that fails alone, and the no-phantom-hit bound sees hits that were never
published."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.verify.generated import GeneratedStage, Scenario, generate, run_scenario, run_stage
from kvpage.verify.generated import generator as gen
from kvpage.verify.generated.coverage import coverage_table
from kvpage.verify.generated.scenario import EventScenario, RequestScenario
from kvpage.verify.generated.stage import failure_signature
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.suites import Runtime

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def runtime():
    model, tokenizer = load_model(MODEL)
    return Runtime(model, tokenizer, MODEL)


def mutant_runtime(base: Runtime, name: str) -> Runtime:
    mutant = next(m for m in MUTANTS if m.name == name)

    def factory(cfg: EngineConfig) -> LLMEngine:
        engine = LLMEngine(replace(cfg, **mutant.config), base.model, base.tokenizer)
        mutant.apply(engine)
        return engine

    rt = Runtime(base.model, base.tokenizer, MODEL, debug_checks=False, engine_factory=factory)
    rt._refs = base._refs
    return rt


def test_a_scenario_is_its_seed_and_index():
    assert generate(3, 7).to_json() == generate(3, 7).to_json()
    assert generate(3, 7).to_json() != generate(3, 8).to_json()
    assert generate(3, 7).to_json() != generate(4, 7).to_json()


def test_a_scenario_survives_json(tmp_path):
    scenario = generate(0, 5)
    again = Scenario.read(scenario.write(tmp_path / "s.json"))
    assert again == scenario
    with pytest.raises(ValueError, match="kvpage-scenario"):
        Scenario.from_json(json.dumps({"format": "other"}))


def test_the_generator_reaches_every_value_it_draws():
    table = coverage_table([generate(0, i) for i in range(80)])
    expected = {
        "block_size": gen.BLOCK_SIZES,
        "kv_cache_dtype": gen.KV_CACHE_DTYPES,
        "pool": gen.POOLS,
        "budget": gen.BUDGETS,
        "preemption": gen.PREEMPTION,
        "sampling": gen.SAMPLING,
        "stop": (*gen.STOPS, "timeout"),
        "shared_offset": (-1, 0, 1),
        "n": (1, 2, 3, 4),
        "prefix_caching": (True, False),
        "abort_state": ("waiting", "prefill", "running", "swapped"),
        "events": gen.EVENTS,
    }
    for dimension, values in expected.items():
        assert set(map(str, values)) <= set(table[dimension]), dimension
    patterns = ("off_window", "siblings", "aligned_again", "transplanted", "prompt_logprobs")
    assert set(patterns) <= set(table)


def test_the_honest_engine_passes_generated_scenarios(runtime):
    result = run_stage(GeneratedStage(seed=11, count=10), runtime)
    failed = [(r.case, r.failures[0].message) for r in result.results if not r.passed]
    assert not failed
    assert len(result.results) == 10 and result.stopped_by == "count"


def test_the_time_budget_stops_the_stage(runtime):
    result = run_stage(GeneratedStage(seed=11, count=None, budget_s=0.0), runtime)
    assert result.stopped_by == "time budget" and len(result.results) <= 1


def test_a_planted_bug_is_caught_shrunk_and_replayable(runtime, tmp_path):
    broken = mutant_runtime(runtime, "max_tokens_off_by_one")
    stage = GeneratedStage(seed=0, count=12, shrink_budget_s=60.0)
    result = run_stage(stage, broken, report_dir=tmp_path)
    assert not result.passed and result.reproducers
    failing = next(s for s, r in zip(result.scenarios, result.results, strict=True) if not r.passed)
    small = Scenario.read(result.reproducers[0])
    assert small.size < failing.size
    replayed = run_scenario(small, broken)
    assert not replayed.passed and failure_signature(replayed)[1] == "stop_rule"
    assert run_scenario(small, runtime).passed  # the reproducer is the bug's, not the scenario's


def _prefix_then_probe(switch: EventScenario) -> Scenario:
    shared = list(range(10, 26))  # two 8-token blocks
    requests = [
        RequestScenario("writer", shared + [40, 41], max_tokens=2),
        RequestScenario("probe", shared + [50, 51], arrive_step=8, max_tokens=2),
    ]
    on_again = EventScenario("switch", 6, switch=switch.switch, enabled=True)
    engine = dict(block_size=8, num_blocks=32)
    return Scenario("published_while_off", engine, requests, [switch, on_again])


@pytest.mark.parametrize(
    "name, switch",
    [
        ("global_switch_lookup_only", EventScenario("switch", 0, switch="prefix_caching")),
        (
            "tenant_switch_lookup_only",
            EventScenario("switch", 0, switch="namespace_caching", cache_salt=None),
        ),
    ],
)
def test_a_hit_on_blocks_published_while_caching_was_off_is_caught(runtime, name, switch):
    """The writer runs while caching is off; the probe comes after it is back on. The KV it
    would read is right (same tokens), so only the bound on what was published sees it."""
    scenario = _prefix_then_probe(switch)
    assert run_scenario(scenario, runtime).passed
    result = run_scenario(scenario, mutant_runtime(runtime, name))
    assert not result.passed
    div = result.first_divergence
    assert div is not None and div.attribution.cls == "prefix_key"
    assert "published" in div.detail and not div.attribution.missing


@pytest.mark.parametrize(
    "name",
    [
        # A sample forked in the step after a request was held is new to the plan but was never
        # waiting: the hold property once counted it as admitted past the held request.
        "fork_is_not_an_admission",
        # Blocks computed while caching was off are published by the writer's first step once it
        # is back on: the hit bound once required the step that completed the block.
        "published_when_back_on",
    ],
)
def test_scenarios_that_once_raised_false_alarms_pass(runtime, name):
    scenario = Scenario.read(Path(__file__).parent / "scenarios" / f"{name}.json")
    result = run_scenario(scenario, runtime)
    assert result.passed, [f.message for f in result.failures]
