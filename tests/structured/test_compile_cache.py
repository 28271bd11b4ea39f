"""The compiled grammar is cached by the constraint's content: a second request with the same
schema copies it (grammar_cache_hits grows, grammar_compiles stays), a schema with the same title
and other content compiles anew. A constraint that does not compile is an InvalidRequest naming
its field once; nothing is queued or held, and the engine serves the next request."""

from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams, StructuredOutputsParams
from kvpage.errors import InvalidRequest

from .constraints import valid

MODEL = "builtin:tiny-llama"
SCHEMA = {
    "title": "Point",
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}
RENAMED = SCHEMA | {"properties": {"y": {"type": "boolean"}}, "required": ["y"]}


@pytest.fixture
def llm():
    with LLM(model=MODEL, block_size=8, debug_checks=True) as llm:
        yield llm


def _run(llm: LLM, constraint: StructuredOutputsParams) -> str:
    params = SamplingParams(max_tokens=40, structured_outputs=constraint)
    (out,) = llm.generate(["the point is"], params, use_tqdm=False)
    (sample,) = out.outputs
    assert sample.finish_reason == "stop" and valid(constraint, sample.text), sample
    return sample.text


def _grammar_stats(llm: LLM) -> tuple[int, int]:
    stats = llm.stats()
    return stats["grammar_compiles"], stats["grammar_cache_hits"]


def test_the_same_schema_compiles_once_and_a_renamed_one_anew(llm):
    assert _grammar_stats(llm) == (0, 0)
    first = _run(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert _grammar_stats(llm) == (1, 0)
    again = _run(llm, StructuredOutputsParams(json=dict(SCHEMA), disable_any_whitespace=True))
    assert again == first
    assert _grammar_stats(llm) == (1, 1)
    # the same title over other content: a cache keyed by the schema's name would hand back
    # Point's grammar and the output would not validate against this schema
    other = StructuredOutputsParams(json=RENAMED, disable_any_whitespace=True)
    assert other.schema_name == "Point"
    _run(llm, other)
    assert _grammar_stats(llm) == (2, 1)


BAD = {
    "json": {"type": "object", "properties": {"a": {"type": "strng"}}},
    "regex": "[a-z",
    "grammar": "start: (",
}
BAD_GBNF = 'root ::= "a'
UNKNOWN_FORMAT = {"type": "string", "format": "no-such-format"}


def _assert_idle(llm: LLM) -> None:
    s = llm.stats()
    assert s["private_blocks"] == s["shared_blocks"] == 0, s
    assert s["free_blocks"] + s["cached_blocks"] == s["num_blocks"], s
    assert s["running"] == s["waiting"] == s["swapped"] == 0, s


@pytest.mark.parametrize(
    ("field", "value"),
    [*BAD.items(), ("grammar", BAD_GBNF), ("json", UNKNOWN_FORMAT)],
    ids=["schema", "regex", "lark", "gbnf", "format"],
)
def test_a_constraint_that_does_not_compile_is_refused_by_name(llm, field, value):
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(**{field: value}))
    with pytest.raises(InvalidRequest) as err:
        llm.generate(["before it", "the bad one"], [good, bad], use_tqdm=False)
    message = str(err.value)
    assert message.startswith(f"prompts[1]: structured_outputs.{field}: "), message
    assert message.count("structured_outputs") == 1, message
    _assert_idle(llm)
    assert _run(llm, StructuredOutputsParams(regex="[a-z]{2,4}"))
    _assert_idle(llm)
