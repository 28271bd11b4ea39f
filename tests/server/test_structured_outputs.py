"""Structured outputs on the server (issue 43 item 2): OpenAI's `response_format` (json_object,
json_schema) and vLLM's `structured_outputs` field on /v1/completions and /v1/chat/completions,
streamed and not, against a live server on a random-weight model (the built-in byte tokenizer).
Every output that ends with "stop" is checked by an independent checker: `jsonschema` for
schemas, `re.fullmatch` for regexes and grammars (each written as a regex too), membership for
choices. A constraint the grammar engine refuses is a 400 naming the field, before any stream,
and the server goes on serving.

Random weights may write JSON whitespace until max_tokens where whitespace is allowed
(response_format cannot turn it off, as in vLLM): those outputs end with "length" and are not
validated, but most must end with "stop". With `disable_any_whitespace` every one must."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvpage import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from kvpage.server import ServerOptions, create_app
from kvpage.server.audit import AuditLog
from kvpage.server.background import BackgroundServer
from kvpage.server.shadow import ShadowChecker, ShadowJob

from .conftest import MODEL

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SMALL = {  # few tokens, so that whitespace runs leave room to finish
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: "ab" pair "!"\npair: ("c" | "d") ("c" | "d")'
LARK_REGEX = r"ab[cd]{2}!"
GBNF = 'root ::= "x" [0-9] [0-9]?'
GBNF_REGEX = r"x[0-9][0-9]?"


class Served:
    def __init__(self, url: str) -> None:
        self.url = url

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=120)

    def ok(self, path: str, body: dict) -> list[tuple[str, str]]:
        """(text, finish_reason) of every choice."""
        r = self.post(path, _with_prompt(path, body))
        assert r.status_code == 200, r.text
        return [(_text(path, c), c["finish_reason"]) for c in r.json()["choices"]]

    def streamed(self, path: str, body: dict) -> list[tuple[str, str]]:
        """(text, finish_reason) of every choice, from the stream's deltas."""
        r = self.post(path, {**_with_prompt(path, body), "stream": True})
        assert r.status_code == 200, r.text
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for event in events[:-1]:
            for c in json.loads(event)["choices"]:
                piece = c["text"] if path == COMPLETIONS else c["delta"].get("content") or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c["finish_reason"] is not None:
                    finish[c["index"]] = c["finish_reason"]
        return [(texts[i], finish[i]) for i in sorted(texts)]

    def refused(self, path: str, body: dict, param: str) -> str:
        r = self.post(path, _with_prompt(path, body))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        return error["message"]

    def stats(self) -> dict:
        r = httpx.get(f"{self.url}/admin/stats", headers={"X-Admin-Token": "t"}, timeout=30)
        return r.json()


def _with_prompt(path: str, body: dict) -> dict:
    return {("prompt" if path == COMPLETIONS else "messages"): _PROMPTS[path], **body}


_PROMPTS = {COMPLETIONS: "A person:", CHAT: MESSAGES}


def _text(path: str, choice: dict) -> str:
    return choice["text"] if path == COMPLETIONS else choice["message"]["content"]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=128, max_num_seqs=16))
    options = ServerOptions(model_name=MODEL, shadow_rate=0.0, admin_token="t")
    with BackgroundServer(create_app(engine, options)) as bg:
        yield Served(bg.url)


def _validated(outputs: list[tuple[str, str]], check, all_stop: bool, least: int = 0) -> None:
    """Every output ending "stop" passes `check`; with `all_stop` every one ends so, else most
    (at least `least` where the constraint leaves strings unbounded)."""
    stopped = [text for text, finish in outputs if finish == "stop"]
    assert set(f for _, f in outputs) <= {"stop", "length"}, outputs
    if all_stop:
        assert len(stopped) == len(outputs), outputs
    elif least:
        assert len(stopped) >= least, outputs
    else:
        assert 2 * len(stopped) > len(outputs), outputs
    for text in stopped:
        check(text)


def _schema_check(schema: dict):
    return lambda text: jsonschema.validate(json.loads(text), schema)


def _regex_check(pattern: str):
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), (pattern, text)

    return check


# --- vLLM's structured_outputs ----------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_structured_outputs_json_schema_validates(served, path, stream):
    body = {
        "structured_outputs": {"json": PERSON, "disable_any_whitespace": True},
        "max_tokens": 120,
        "n": 3,
        "seed": 11,
    }
    outputs = (served.streamed if stream else served.ok)(path, body)
    assert len(outputs) == 3
    _validated(outputs, _schema_check(PERSON), all_stop=True)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"regex": REGEX}, _regex_check(REGEX)),
        ({"grammar": LARK}, _regex_check(LARK_REGEX)),
        ({"grammar": GBNF}, _regex_check(GBNF_REGEX)),
    ],
    ids=["regex", "lark", "gbnf"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_structured_outputs_regex_and_grammars_match(served, constraint, check, stream):
    body = {"structured_outputs": constraint, "max_tokens": 40, "n": 3, "temperature": 1.0}
    outputs = (served.streamed if stream else served.ok)(COMPLETIONS, {**body, "seed": 5})
    _validated(outputs, check, all_stop=True)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_structured_outputs_choice_is_one_of_them(served, path):
    body = {"structured_outputs": {"choice": CHOICES}, "max_tokens": 10, "n": 4, "seed": 2}
    outputs = served.ok(path, body)

    def check(text: str) -> None:
        assert text in CHOICES, text

    _validated(outputs, check, all_stop=True)
    greedy = served.ok(path, {**body, "n": 1, "temperature": 0.0})
    _validated(greedy, check, all_stop=True)


def test_a_batch_of_prompts_shares_the_constraint(served):
    body = {"prompt": ["one", "two", "three"], "structured_outputs": {"regex": REGEX}}
    r = served.post(COMPLETIONS, {**body, "max_tokens": 20, "seed": 1})
    assert r.status_code == 200, r.text
    outputs = [(c["text"], c["finish_reason"]) for c in r.json()["choices"]]
    assert len(outputs) == 3
    _validated(outputs, _regex_check(REGEX), all_stop=True)


# --- OpenAI's response_format -----------------------------------------------------------------
def _json_schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "small", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_response_format_json_schema_validates(served, path, stream):
    body = {"response_format": _json_schema_format(SMALL), "max_tokens": 200, "n": 6, "seed": 3}
    outputs = (served.streamed if stream else served.ok)(path, body)
    _validated(outputs, _schema_check(SMALL), all_stop=False)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_response_format_json_object_is_an_object(served, path):
    """Any object: its keys and strings are unbounded, so a random model may write one to
    max_tokens; a third of the draws must still finish."""
    body = {"response_format": {"type": "json_object"}, "max_tokens": 200, "n": 6, "seed": 4}

    def check(text: str) -> None:
        assert isinstance(json.loads(text), dict), text

    _validated(served.ok(path, body), check, all_stop=False, least=2)


def test_response_format_text_is_no_constraint(served):
    body = {"max_tokens": 12, "temperature": 0.0}
    free = served.ok(CHAT, body)
    assert served.ok(CHAT, {**body, "response_format": {"type": "text"}}) == free


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)


def test_openai_parse_returns_the_pydantic_object(served):
    """The openai SDK's structured outputs: the model's JSON schema as response_format (strict),
    and the reply parsed into the model. Some draws may write whitespace to max_tokens (the SDK
    raises LengthFinishReasonError); most finish, and each that does parses."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=120)
    parsed = []
    for seed in range(4):
        try:
            completion = client.chat.completions.parse(
                model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=200, seed=seed
            )
        except openai.LengthFinishReasonError:
            continue
        message = completion.choices[0].message
        assert isinstance(message.parsed, Pet), message
        assert Pet.model_validate_json(message.content) == message.parsed
        parsed.append(message.parsed)
    assert len(parsed) >= 2, parsed


# --- refusals -------------------------------------------------------------------------------
BAD = [  # (path, body, param, what the message names)
    (COMPLETIONS, {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "regex"),
    (CHAT, {"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "grammar"),
    (
        COMPLETIONS,
        {"structured_outputs": {"json": {"type": "string", "format": "no-such-format"}}},
        "structured_outputs",
        "structured_outputs.json",
    ),
    (COMPLETIONS, {"structured_outputs": {"json": "{not json"}}, "structured_outputs", "json"),
    (
        CHAT,
        {"response_format": _json_schema_format({"type": "no-such-type"})},
        "response_format",
        "response_format.json_schema.schema",
    ),
    (
        COMPLETIONS,
        {"response_format": {"type": "json_schema"}},
        "response_format",
        "json_schema",
    ),
    (
        COMPLETIONS,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "schema",
    ),
    (
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "exactly one",
    ),
    (COMPLETIONS, {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    (
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "structured_outputs",
        "whitespace_pattern",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "send one of them",
    ),
    (
        COMPLETIONS,
        {"prompt": ["a", "b"], "structured_outputs": {"regex": "(unclosed"}},
        "structured_outputs",
        "regex",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "named"), BAD)
def test_bad_constraint_is_400_naming_the_field(served, path, body, param, named):
    message = served.refused(path, {"max_tokens": 4, **body}, param)
    assert named in message, message


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_refusal_comes_before_any_stream_and_the_server_goes_on(served, path):
    before = served.stats()
    bad = {"structured_outputs": {"regex": "[a-z"}, "max_tokens": 4, "stream": True}
    r = served.post(path, _with_prompt(path, bad))
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "structured_outputs"
    good = {"structured_outputs": {"choice": CHOICES}, "max_tokens": 8}
    outputs = served.ok(path, good)
    assert outputs[0][0] in CHOICES and outputs[0][1] == "stop"
    after = served.stats()
    assert after["running"] == after["waiting"] == 0
    assert after["grammar_compiles"] >= before["grammar_compiles"]


def test_a_repeated_schema_compiles_once(served):
    body = {"structured_outputs": {"json": SMALL, "disable_any_whitespace": True}}
    served.ok(COMPLETIONS, {**body, "max_tokens": 30})
    before = served.stats()
    served.ok(COMPLETIONS, {**body, "max_tokens": 30, "seed": 9})
    after = served.stats()
    assert after["grammar_compiles"] == before["grammar_compiles"]
    assert after["grammar_cache_hits"] == before["grammar_cache_hits"] + 1


def test_the_shadow_replays_a_constrained_request():
    """The server's shadow comparison recomputes a constrained sample through the reference's
    own grammar: the same tokens; unconstrained, the reference draws others (it can fail)."""
    llm = LLM(model=MODEL)
    checker = ShadowChecker(llm.engine.model, AuditLog(sample_rate=0.0), 1.0, model_name=MODEL)
    prompt_ids = [256, *b"A code:"]
    constraint = StructuredOutputsParams(regex=REGEX)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured_outputs=constraint)
    served = llm.generate(prompt_ids, params, use_tqdm=False)[0].outputs[0]
    assert served.finish_reason == "stop" and re.fullmatch(REGEX, served.text)
    assert checker.check(ShadowJob("c", prompt_ids, params, served.token_ids, 16)) is None
    free = replace(params, structured_outputs=None)
    assert checker.check(ShadowJob("f", prompt_ids, free, served.token_ids, 16)) is not None
    assert checker.counts() == (2, 1)
