"""The generated stage: scenarios are reproducible plain data, they reach every value of the
dimensions they draw, the honest engine passes them, a planted bug is caught, shrunk and
written as a reproducer that fails alone, and the no-phantom-hit bound sees hits that were never
published."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.reference.weight_oracle import reference_model
from kvpage.verify.generated import (
    GeneratedStage,
    Scenario,
    generate,
    run_scenario,
    run_stage,
    served,
)
from kvpage.verify.generated import generator as gen
from kvpage.verify.generated.alone import focus_order, generated_alone
from kvpage.verify.generated.coverage import coverage_table
from kvpage.verify.generated.scenario import EventScenario, RequestScenario, to_case
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
    # Scenario 0 already fails (a scenario is its seed and index): the one whose reproducer is
    # checked below. More scenarios would each be shrunk too, and nothing looks at them.
    stage = GeneratedStage(seed=0, count=1, shrink_budget_s=60.0)
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


# --- draws from the served configuration (kvpage.verify.generated.served) ---------------------
def _smallest(key: str, value=None, count: int = 120, windows=()) -> Scenario:
    """The smallest of the first `count` scenarios of seed 0 that drew `key` (= `value`)."""
    found = [
        s
        for s in (generate(0, i, windows=windows) for i in range(count))
        if key in s.covers and (value is None or value in s.covers[key])
    ]
    assert found, key
    return min(found, key=lambda s: s.size)


def test_the_generator_draws_the_served_configuration():
    table = coverage_table([generate(0, i) for i in range(80)])
    expected = {
        "max_loras": served.MAX_LORAS,
        "lora_rank": served.LORA_RANKS,
        "lora_rslora": (True, False),
        "lora_targets": tuple(served.LORA_TARGETS),
        "prompt_rows": served.ROWS_PATTERNS,
        "lora_adapters": (2, 3),
    }
    for dimension, values in expected.items():
        assert set(map(str, values)) <= set(table[dimension]), dimension
    for pattern in ("lora_reload", "lora_mixed", "lora_named_like_salt", "eviction_order"):
        assert pattern in table, pattern
    assert {"seeded_recompute", "off_window_fitted"} <= set(table)
    assert "window_hit" not in table  # tiny-llama's layers are global: no window to cut at
    windowed = coverage_table([generate(0, i, windows=(12,)) for i in range(40)])
    assert set(windowed["window_hit"]) == {"shorter", "longer"}


def test_served_draws_keep_the_rest_of_a_scenario():
    """Each draw has a stream of its own: a model's windows change only the prefix cuts."""
    plain, windowed = generate(0, 3), generate(0, 3, windows=(12,))
    assert plain.engine.keys() == windowed.engine.keys()
    with_adapters = [i for i in range(20) if "lora_adapters" in generate(0, i).covers]
    assert with_adapters
    for i in with_adapters:  # GPT-2: the engine serves no adapter there; int8 weights: it does
        int8 = generate(0, i, fixed={"quantization": "int8"})
        assert int8.covers["lora_adapters"] == generate(0, i).covers["lora_adapters"]
        assert "lora_adapters" not in generate(0, i, adapters=False).covers


def test_adapter_draws_are_real_configurations():
    for s in (generate(0, i) for i in range(80)):
        specs = [r.lora_spec() for r in s.requests if r.lora is not None]
        for spec in specs:
            assert spec.alpha != spec.rank and spec.rank in served.LORA_RANKS
        if specs:
            assert 1 <= s.engine["max_loras"] <= 3
            assert any(r.lora is None for r in s.requests)  # base requests beside them
            assert all(r.prompt_logprobs is None for r in s.requests if r.lora is not None)


def test_a_hold_never_pins_a_scarce_adapter_slot():
    a = {"name": "a", "seed": 1, "targets": ["q_proj"], "rank": 2, "alpha": 4.0, "rslora": False}
    b = {**a, "name": "b"}
    requests = [RequestScenario("x", [5] * 9, lora=a), RequestScenario("y", [6] * 9, lora=b)]
    requests.append(RequestScenario("z", [7] * 9))
    events = [EventScenario("preempt", 0, rid, after_tokens=1) for rid in ("x", "y", "z")]
    assert [e.request_id for e in served.holds_within_slots(events, requests, 1)] == ["z"]
    assert served.holds_within_slots(events, requests, 2) == events


def test_top_next_is_a_kept_top_token_of_the_writer(runtime):
    prompt = list(range(10, 30))
    request = RequestScenario("z", prompt, prompt_logprobs=1, top_next=[8, 1])
    scenario = Scenario("t", {"block_size": 8}, [request])
    resolved = to_case(scenario, runtime.model).requests[0].prompt
    logits = reference_model(runtime.model).forward_full(prompt[:8])[-1]
    assert resolved[8] == int(torch.topk(logits.float(), 2).indices[1])
    assert resolved[:8] == prompt[:8] and resolved[9:] == prompt[9:]
    assert to_case(scenario).requests[0].prompt == prompt  # no model: the drawn token stays


def test_an_eviction_order_scenario_states_exact_hits_and_catches_fifo(runtime):
    scenario = _smallest("eviction_order")
    assert scenario.expect_hit_tokens["R.after"] > 0 and not scenario.events
    assert run_scenario(scenario, runtime).passed
    assert not run_scenario(scenario, mutant_runtime(runtime, "fifo_eviction")).passed


@pytest.mark.parametrize(
    "pattern, name",
    [
        ("tenants", "prompt_rows_from_another_namespace"),
        ("reused", "prompt_rows_after_generation_change"),
    ],
)
def test_kept_prompt_rows_are_served_and_checked(runtime, pattern, name):
    scenario = _smallest("prompt_rows", pattern)
    assert run_scenario(scenario, runtime).passed
    result = run_scenario(scenario, mutant_runtime(runtime, name))
    assert not result.passed


@pytest.mark.parametrize("name", ["lora_keyed_by_name", "lora_slot_keeps_old_factors"])
def test_an_adapter_scenario_passes_and_catches_adapter_bugs(runtime, name):
    found = [
        s
        for s in (generate(0, i) for i in range(120))
        if s.covers.get("lora_reload") and s.covers.get("max_loras") == 1
    ]
    scenario = min(found, key=lambda s: s.size)
    assert run_scenario(scenario, runtime).passed
    assert not run_scenario(scenario, mutant_runtime(runtime, name)).passed


def test_the_alone_pass_stops_at_the_first_catch_and_runs_a_mutants_dimensions_first():
    scenarios = [generate(0, i) for i in range(12)]
    lora = next(m for m in MUTANTS if m.name == "lora_wrong_scale")
    ordered = focus_order(lora, scenarios)
    firsts = [s for s in ordered if "lora_adapters" in s.covers]
    assert firsts and ordered[: len(firsts)] == firsts
    ran = []

    class Ran:
        def __init__(self, case):
            self.caught, self.caught_by = len(ran) == 2, [case.full_name]
            self.attributed_class, self.seconds = "lora", 0.1

    def run_mutant(mutant, model, tokenizer, name, cases, runtime):
        assert len(cases) == 1
        ran.append(cases[0].name)
        return Ran(cases[0])

    model = type("M", (), {"config": None})()
    generated = type("G", (), {"scenarios": scenarios, "results": [_Passed()] * 12})()
    out = generated_alone([lora], model, None, MODEL, generated, None, run_mutant)
    assert len(ran) == 2 and out[0].caught and out[0].caught_by.endswith(ran[-1])


class _Passed:
    passed = True
