"""Issue 43's acceptance on generated constraints: 50 JSON schemas, 30 regexes and choice lists,
each a request in one batch, greedy and sampled (seeded), at n = 1 and n = 3. Every sample that
ends with "stop" satisfies its constraint by the independent checker, and most end with "stop"
(the check is not vacuous). A grammar that completes ends its request at once."""

from __future__ import annotations

import re

import pytest

from kvpage import LLM, SamplingParams, StructuredOutputsParams

from .constraints import choice_lists, json_schemas, regexes, valid

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def llm():
    with LLM(model=MODEL, debug_checks=True) as llm:
        yield llm


def constraints() -> list[tuple[StructuredOutputsParams, dict | None]]:
    """Each constraint with the schema as written (None: not a schema), for the checker."""
    schemas = [
        (StructuredOutputsParams(json=s, disable_any_whitespace=True), s)
        for s in json_schemas(50, 43)
    ]
    patterns = [(StructuredOutputsParams(regex=r), None) for r in regexes(30, 43)]
    choices = [(StructuredOutputsParams(choice=c), None) for c in choice_lists(10, 43)]
    return schemas + patterns + choices


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_stopped_output_validates(llm, n, temperature):
    cases = constraints()
    params = [
        SamplingParams(
            n=n, temperature=temperature, seed=i, max_tokens=96, structured_outputs=constraint
        )
        for i, (constraint, _) in enumerate(cases)
    ]
    prompts = [f"request {i}: answer" for i in range(len(cases))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    finishes = []
    for (constraint, schema), out in zip(cases, outputs, strict=True):
        assert len(out.outputs) == n
        for sample in out.outputs:
            finishes.append(sample.finish_reason)
            assert sample.finish_reason in ("stop", "length"), (sample.finish_reason, out)
            if sample.finish_reason == "stop":
                assert valid(constraint, sample.text, schema), (constraint, sample.text)
    stopped = finishes.count("stop") / len(finishes)
    assert stopped >= 0.8, f"only {stopped:.0%} of the samples stopped: the check is vacuous"
    if temperature > 0 and n > 1:
        distinct = sum(len({s.text for s in out.outputs}) > 1 for out in outputs)
        assert distinct >= len(outputs) // 4, "parallel samples of a request barely differ"


def test_a_completed_choice_stops_without_another_token(llm):
    choices = ["north", "south", "x"]  # none is a prefix of another: each ends the grammar
    constraint = StructuredOutputsParams(choice=choices)
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=50, structured_outputs=constraint)
        for i, t in enumerate([0.0, 1.0, 1.0, 1.0, 2.0, 2.0])
    ]
    outputs = llm.generate(["pick one"] * len(params), params, use_tqdm=False)
    tokenizer = llm.tokenizer
    for out in outputs:
        (sample,) = out.outputs
        assert sample.finish_reason == "stop"
        assert sample.text in choices
        # exactly the choice's bytes: no EOS drawn after it, nothing past the grammar's end
        assert sample.token_ids == tokenizer.encode(sample.text, False), sample.token_ids


# Lark and GBNF grammars, each with the Python regex it stands for (the independent checker)
GRAMMARS = [
    ('start: WORD "=" NUM\nWORD: /[a-z]{1,5}/\nNUM: /[0-9]{1,3}/', r"[a-z]{1,5}=[0-9]{1,3}"),
    ('start: "(" item ("," item)* ")"\nitem: "yes" | "no"', r"\((yes|no)(,(yes|no))*\)"),
    ('root ::= [a-f]{2,4} "-" ("x" | "y")', r"[a-f]{2,4}-(x|y)"),
    ('root ::= "k" [0-9] [0-9]?', r"k[0-9][0-9]?"),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lark_and_gbnf_outputs_match_their_regex(llm, temperature):
    params = [
        SamplingParams(
            n=3,
            temperature=temperature,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(grammar=grammar),
        )
        for i, (grammar, _) in enumerate(GRAMMARS)
    ]
    outputs = llm.generate([f"grammar {i}" for i in range(len(params))], params, use_tqdm=False)
    for (_, pattern), out in zip(GRAMMARS, outputs, strict=True):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample
            assert re.fullmatch(pattern, sample.text), (pattern, sample.text)
