"""The prompt-logprob cases: an honest engine passes them; each prompt-logprob mutant is caught
by the row check against the reference and attributed to the prompt_logprobs class."""

from __future__ import annotations

import pytest

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.verify.cases.prompt_logprobs import prompt_logprob_cases, run_prompt_logprob_case
from kvpage.verify.diff import REQUIRED_FIELDS
from kvpage.verify.mutants.prompt_logprobs import PROMPT_LOGPROB_MUTANTS
from kvpage.verify.suites import Runtime, run_case

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def _engine(loaded, case) -> LLMEngine:
    model, tokenizer = loaded
    return LLMEngine(EngineConfig(model=MODEL, debug_checks=True, **case.engine), model, tokenizer)


def test_honest_engine_passes_every_prompt_logprob_case(loaded):
    cases = prompt_logprob_cases(loaded[0].config.vocab_size)
    assert len(cases) == 4
    for case in cases:
        engine = _engine(loaded, case)
        assert run_prompt_logprob_case(case, engine, loaded[0]) == [], case.name
        assert engine.stats()["preemptions"] >= int(case.expect_preemption)


# Rows from another namespace or from a reused block hold the right numbers (same tokens): only
# provenance, in the gate's run_case, tells them apart (the test below).
SAME_VALUES = {"prompt_rows_from_another_namespace", "prompt_rows_after_generation_change"}
VALUE_MUTANTS = [m for m in PROMPT_LOGPROB_MUTANTS if m.name not in SAME_VALUES]


@pytest.mark.parametrize("mutant", VALUE_MUTANTS, ids=lambda m: m.name)
def test_the_row_check_catches_each_mutant_and_attributes_it(loaded, mutant):
    caught = []
    for case in prompt_logprob_cases(loaded[0].config.vocab_size):
        engine = _engine(loaded, case)
        mutant.apply(engine)
        caught += run_prompt_logprob_case(case, engine, loaded[0])
    assert caught, f"{mutant.name} was not caught"
    attribution = caught[0].divergence.attribution
    assert attribution.cls == "prompt_logprobs"
    assert attribution.missing == []
    assert set(REQUIRED_FIELDS["prompt_logprobs"]) <= set(attribution.fields)


@pytest.mark.parametrize("mutant", PROMPT_LOGPROB_MUTANTS, ids=lambda m: m.name)
def test_the_gate_catches_its_prompt_logprob_mutants(loaded, mutant):
    """What the gate runs (run_case and its own checks) catches the mutants registered there,
    first divergence in their expected class."""
    model, tokenizer = loaded

    def factory(cfg):
        engine = LLMEngine(cfg, model, tokenizer)
        mutant.apply(engine)
        return engine

    runtime = Runtime(model, tokenizer, MODEL, engine_factory=factory)
    results = [run_case(c, runtime) for c in prompt_logprob_cases(model.config.vocab_size)]
    divergences = [r.first_divergence for r in results if r.first_divergence is not None]
    assert divergences, f"{mutant.name} was not caught"
    assert divergences[0].attribution.cls == mutant.expected_class
    assert divergences[0].attribution.missing == []


def test_an_adapter_requests_prompt_rows_are_checked_against_its_own_reference(monkeypatch):
    """Rows of a request with an adapter come from the adapter's merged reference: they pass,
    and the same rows judged against the base model's reference fail."""
    from kvpage.model import load_model
    from kvpage.sampling_params import SamplingParams
    from kvpage.verify.case import Case, RequestSpec
    from kvpage.verify.cases.lora import A
    from kvpage.verify.suites import Runtime, run_case

    model, tokenizer = load_model("builtin:tiny-llama")
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    spec = RequestSpec("scored", list(range(30, 60)), params, lora=A)
    case = Case("prompt_logprobs", "adapter rows", [spec], dict(block_size=8, num_blocks=32))
    runtime = Runtime(model, tokenizer, "builtin:tiny-llama")
    assert run_case(case, runtime).passed
    base_only = Runtime(model, tokenizer, "builtin:tiny-llama")
    original = base_only.reference_model
    monkeypatch.setattr(base_only, "reference_model", lambda lora: original(None))
    failed = run_case(case, base_only)
    assert any(f.divergence and f.divergence.attribution.cls == "prompt_logprobs"
               for f in failed.failures)  # fmt: skip
