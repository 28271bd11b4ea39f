"""The LoRA cases: an honest engine passes them (each adapter request equal to the reference's
own merge, the hit counts exact); each LoRA mutant is caught, first divergence in the lora class
with its fields."""

from __future__ import annotations

import pytest

from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.verify.cases.lora import lora_cases
from kvpage.verify.diff import REQUIRED_FIELDS
from kvpage.verify.mutants.lora import LORA_MUTANTS
from kvpage.verify.suites import Runtime, run_case

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def test_honest_engine_passes_every_lora_case(loaded):
    model, tokenizer = loaded
    runtime = Runtime(model, tokenizer, MODEL)
    cases = lora_cases(model.config.vocab_size)
    assert len(cases) == 6
    stats = {}
    for case in cases:
        result = run_case(case, runtime)
        assert result.failures == [], (case.name, [f.message for f in result.failures])
        stats[case.name] = result.stats
    preempted = stats["adapters preempted by recompute and swap, a parallel request with an adapter"]
    assert preempted["preemptions"] >= 2


def test_the_adapters_change_what_the_model_says(loaded):
    """Else every LoRA case would pass an engine that ignores adapters."""
    model, tokenizer = loaded
    runtime = Runtime(model, tokenizer, MODEL)
    case = lora_cases(model.config.vocab_size)[0]
    outs = {s.request_id: runtime.reference(s, 8).token_ids for s in case.requests}
    assert len({tuple(outs[r]) for r in ("base.1", "a.1", "b.1")}) == 3


@pytest.mark.parametrize("mutant", LORA_MUTANTS, ids=lambda m: m.name)
def test_each_lora_mutant_is_caught_in_the_lora_class(loaded, mutant):
    model, tokenizer = loaded

    def factory(cfg):
        engine = LLMEngine(cfg, model, tokenizer)
        mutant.apply(engine)
        return engine

    runtime = Runtime(model, tokenizer, MODEL, engine_factory=factory)
    results = [run_case(c, runtime) for c in lora_cases(model.config.vocab_size)]
    divergences = [r.first_divergence for r in results if r.first_divergence is not None]
    assert divergences, f"{mutant.name} was not caught"
    attribution = divergences[0].attribution
    assert attribution.cls == "lora" and attribution.missing == []
    assert set(REQUIRED_FIELDS["lora"]) <= set(attribution.fields)
