"""`kvpage generate` with a structured-output constraint: the reference draws inside it, and a
constraint the reference cannot compile is one `error:` line with exit status 2."""

from __future__ import annotations

import json
import re

import jsonschema

from kvpage.cli import main
from kvpage.model import load_model

PROMPT = ["generate", "--model", "builtin:tiny-llama", "--prompt", "hello"]


def _printed(capsys) -> tuple[str, list[int], str]:
    out = capsys.readouterr().out
    ids = json.loads(re.search(r"^token_ids: (.*)$", out, re.M).group(1))
    finish = re.search(r"^finish_reason: (\w+)$", out, re.M).group(1)
    _, tok = load_model("builtin:tiny-llama")
    return tok.decode(ids), ids, finish


def test_generate_regex_output_matches(capsys):
    pattern = "[a-z]{2,4}-[0-9]{1,2}"
    assert main([*PROMPT, "--regex", pattern, "--max-tokens", "16"]) == 0
    text, _, finish = _printed(capsys)
    assert finish == "stop" and re.fullmatch(pattern, text), text


def test_generate_json_schema_output_validates(capsys, tmp_path):
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "c": {"enum": ["x", "y"]},
        },
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    args = [*PROMPT, "--json-schema", f"@{path}", "--disable-any-whitespace", "--max-tokens", "32"]
    assert main(args) == 0
    text, _, finish = _printed(capsys)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_generate_choice_is_one_of_them(capsys):
    assert main([*PROMPT, "--choice", "left", "--choice", "right", "--temperature", "1",
                 "--seed", "3"]) == 0  # fmt: skip
    text, _, finish = _printed(capsys)
    assert finish == "stop" and text in ("left", "right")


def test_generate_bad_regex_is_one_error_line(capsys):
    assert main([*PROMPT, "--regex", "(ab"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "regex" in err and len(err.strip().splitlines()) == 1
