"""The mutation check at TP=2 for the quantized-KV mutants that rank 0 alone could not
express or that were attributed to the wrong class: each, planted on every rank, fails the
case that catches it at TP=1, attributed to quantized_kv, while the same case passes at TP=2
on the unmutated engine. Builtin tiny-llama: 2 KV heads, so one per rank."""

from __future__ import annotations

import pytest

from kvpage.model import load_model
from kvpage.parallel.executor import shared_workers
from kvpage.verify.gate import run_mutant
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.suites import SUITES, Runtime, build_suites, run_case

MODEL = "builtin:tiny-llama"
CATCHING_CASE = {
    "cow_copies_data_not_scale": "parallel:int8/greedy_forks_cow",
    "one_scale_for_all_heads": "prefix:int8/shared_prefixes_b8",
    "swap_in_without_scales": "preemption:int8/abc_swap",
}


@pytest.fixture(scope="module")
def tp2():
    model, tokenizer = load_model(MODEL, "float32")
    cases = {c.full_name: c for c in build_suites(model.config.vocab_size, SUITES, ("int8",))}
    with shared_workers():
        runtime = Runtime(model, tokenizer, MODEL, debug_checks=True, tensor_parallel_size=2)
        yield model, tokenizer, runtime, cases


@pytest.mark.parametrize("name", sorted(CATCHING_CASE))
def test_quantized_mutant_is_caught_and_attributed_at_tp2(tp2, name):
    model, tokenizer, runtime, cases = tp2
    case = cases[CATCHING_CASE[name]]
    assert run_case(case, runtime).passed  # the case itself holds on the real engine at TP=2
    mutant = next(m for m in MUTANTS if m.name == name)
    result = run_mutant(mutant, model, tokenizer, MODEL, [case], runtime)
    assert result.caught, name
    assert result.attributed_class == "quantized_kv", result.first_failure
    assert result.attribution_ok, result.divergence["attribution"]["missing"]
