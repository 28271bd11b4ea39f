"""Prefix caching does not see the grammar (the KV does not depend on it): a constrained request
whose prompt hits the cache gives the same tokens as with caching off, and its first token after
the hit is masked like any other."""

from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams, StructuredOutputsParams

from .constraints import json_schemas, valid

MODEL = "builtin:tiny-llama"
PROMPT = "a shared system prompt, five blocks of eight tokens: then"  # 57 tokens with BOS
CONSTRAINTS = [
    StructuredOutputsParams(regex=r"[0-9]{3,5}"),
    StructuredOutputsParams(choice=["7up", "42nd", "99 red"]),
    StructuredOutputsParams(json=json_schemas(1, 11)[0], disable_any_whitespace=True),
]


def _generate(caching: bool, warm: bool) -> tuple[list, dict]:
    with LLM(model=MODEL, block_size=8, enable_prefix_caching=caching, debug_checks=True) as llm:
        if warm:  # the prompt's blocks cached by a free request first
            llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
        hits = llm.stats()["prefix_hits"]
        params = [SamplingParams(max_tokens=120, structured_outputs=c) for c in CONSTRAINTS]
        outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        free = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
        stats = llm.stats() | {"hits_of_constrained": llm.stats()["prefix_hits"] - hits}
        return [out.outputs[0] for out in outputs] + [free[0].outputs[0]], stats


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "same-step"])
def test_a_cache_hit_changes_no_constrained_token(warm):
    cached, stats = _generate(caching=True, warm=warm)
    assert stats["hits_of_constrained"] > 0, stats
    uncached, _ = _generate(caching=False, warm=warm)
    assert [s.token_ids for s in cached] == [s.token_ids for s in uncached]
    *constrained, free = cached
    # the model's own first token satisfies none of the constraints: the masks made them
    assert not free.text[:1].isdigit() and free.text[:1] != "{", free.text
    for constraint, sample in zip(CONSTRAINTS, constrained, strict=True):
        assert sample.finish_reason == "stop", sample
        assert valid(constraint, sample.text), (constraint, sample.text)
