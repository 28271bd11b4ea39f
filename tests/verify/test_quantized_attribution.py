"""The fourth row of the attribution matrix, decided by the suite: a divergence on a
quantized case is quantized_kv only when the same case with unquantized KV matches the reference.
A cache bug that breaks both keeps its own class even when first seen on an int8 case."""

from __future__ import annotations

import pytest

from kvpage.model import load_model
from kvpage.verify.gate import run_mutant
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.suites import Runtime, build_suites


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model("builtin:tiny-llama")
    cases = build_suites(model.config.vocab_size, ("batching",), ("int8",))
    int8_only = [c for c in cases if c.suite == "batching:int8"]
    return model, tok, int8_only, Runtime(model, tok, "builtin:tiny-llama")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("off_by_one_block_boundary", "block_table"), ("int8_round_toward_zero", "quantized_kv")],
)
def test_only_a_divergence_specific_to_the_quantized_path_is_quantized_kv(setup, name, expected):
    model, tok, cases, runtime = setup
    mutant = next(m for m in MUTANTS if m.name == name)
    result = run_mutant(mutant, model, tok, "builtin:tiny-llama", cases, runtime)
    assert result.caught and result.caught_by[0].startswith("batching:int8/")
    attribution = result.divergence["attribution"]
    assert attribution["class"] == expected and attribution["missing"] == []
    assert result.divergence["candidate"]["view"]["kv_dtype"] == "int8"
