"""n > 1: each parallel sample runs its own copy of the request's matcher, made before the
parent's first token advances it. So sample i of a seeded n = 3 request equals the same request
run alone with `params.for_sample(i)`, the samples differ, and each validates; forks that share
one matcher break that (one sample's tokens advance the others' grammar)."""

from __future__ import annotations

import llguidance.torch
import pytest
import torch

from kvpage import LLM, SamplingParams, StructuredOutputsParams
from kvpage.structured.masks import TokenMasks, unpack

from .constraints import json_schemas, valid

MODEL = "builtin:tiny-llama"
CONSTRAINTS = [
    StructuredOutputsParams(regex=r"[a-z]{3,8}(-[0-9]{1,3})?"),
    StructuredOutputsParams(regex=r"(red|green|blue|cyan)_[a-f]{2,4}"),
    StructuredOutputsParams(choice=["alpha", "beta", "gamma", "delta", "x", "yes"]),
    StructuredOutputsParams(json=json_schemas(1, 3)[0], disable_any_whitespace=True),
]


@pytest.fixture
def llm():
    with LLM(model=MODEL, debug_checks=True) as llm:
        yield llm


def _params(constraint, n: int, seed: int) -> SamplingParams:
    return SamplingParams(
        n=n, temperature=1.5, seed=seed, max_tokens=60, structured_outputs=constraint
    )


def test_each_sample_equals_its_own_run_and_validates(llm):
    prompts = [f"fork case {i}" for i in range(len(CONSTRAINTS))]
    forked = [_params(c, 3, 10 * i) for i, c in enumerate(CONSTRAINTS)]
    outputs = llm.generate(prompts, forked, use_tqdm=False)
    alone = llm.generate(
        [p for p in prompts for _ in range(3)],
        [params.for_sample(i) for params in forked for i in range(3)],
        use_tqdm=False,
    )
    differing = 0
    for r, (constraint, out) in enumerate(zip(CONSTRAINTS, outputs, strict=True)):
        for i, sample in enumerate(out.outputs):
            assert sample.finish_reason == "stop", (constraint, sample)
            assert valid(constraint, sample.text), (constraint, sample.text)
            assert sample.token_ids == alone[3 * r + i].outputs[0].token_ids, (r, i)
        differing += len({s.text for s in out.outputs}) > 1
    assert differing >= 2, "sampled forks gave the same text: are they independent?"


def _fill_one_by_one(masks: TokenMasks, matchers) -> torch.Tensor:
    """TokenMasks.allowed, each row filled alone (the parallel executor refuses a matcher
    that stands in two rows)."""
    bitmask = torch.zeros(len(matchers), masks.words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher.matcher, bitmask, row)
    return unpack(bitmask, masks.vocab_size)


def test_forks_sharing_one_matcher_break_the_grammar(llm, monkeypatch):
    monkeypatch.setattr(llm.engine.grammars, "fork", lambda matcher: matcher)
    prompts = [f"fork case {i}" for i in range(len(CONSTRAINTS))]
    params = [_params(c, 3, 10 * i) for i, c in enumerate(CONSTRAINTS)]
    with pytest.raises(RuntimeError, match="borrowed"):
        llm.generate(prompts, params, use_tqdm=False)


def test_forks_sharing_one_matcher_give_invalid_outputs(monkeypatch):
    """The shared matcher, its rows' masks filled one by one: the engine runs, and each
    sample's tokens advance its siblings' grammar."""
    monkeypatch.setattr(TokenMasks, "allowed", _fill_one_by_one)
    with LLM(model=MODEL, debug_checks=True) as llm:
        monkeypatch.setattr(llm.engine.grammars, "fork", lambda matcher: matcher)
        prompts = [f"fork case {i}" for i in range(len(CONSTRAINTS))]
        params = [_params(c, 3, 10 * i) for i, c in enumerate(CONSTRAINTS)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    broken = [
        (constraint.kind, s.finish_reason, s.text)
        for constraint, out in zip(CONSTRAINTS, outputs, strict=True)
        for s in out.outputs
        if s.finish_reason != "stop" or not valid(constraint, s.text)
    ]
    assert len(broken) >= len(CONSTRAINTS), broken
