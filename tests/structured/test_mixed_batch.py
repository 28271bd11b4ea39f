"""Unconstrained rows beside constrained ones: each free request's tokens equal its tokens in a
batch with no constraint at all, greedy and seeded sampled (their rows are neither masked nor
shifted), and the constrained rows validate."""

from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams, StructuredOutputsParams

from .constraints import choice_lists, json_schemas, regexes, valid

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def llm():
    with LLM(model=MODEL, debug_checks=True) as llm:
        yield llm


def _constraints() -> list[StructuredOutputsParams]:
    return (
        [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in json_schemas(4, 5)]
        + [StructuredOutputsParams(regex=r) for r in regexes(4, 5)]
        + [StructuredOutputsParams(choice=c) for c in choice_lists(2, 5)]
    )


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_free_rows_equal_a_free_batch(llm, temperature):
    free = [
        SamplingParams(temperature=temperature, top_k=40, seed=100 + i, max_tokens=24)
        for i in range(10)
    ]
    constrained = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=60, structured_outputs=c)
        for i, c in enumerate(_constraints())
    ]
    free_prompts = [f"free request {i}" for i in range(len(free))]
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    # interleaved, so a mask shifted by one row would land on a free row
    params = [p for pair in zip(constrained, free, strict=True) for p in pair]
    prompts = [p for i, f in enumerate(free_prompts) for p in (f"constrained {i}", f)]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == [o.outputs[0].token_ids for o in alone]
    for constraint, out in zip(_constraints(), mixed[0::2], strict=True):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample
        assert valid(constraint, sample.text), (constraint, sample.text)
