"""Generated constraints for the structured-output tests, and their independent checker.

Every schema, regex and choice list is drawn from a seeded generator and bounded (integers with
a range, strings with maxLength, arrays with maxItems, enums), so a random-weight model's
constrained output ends. The checker is not llguidance: `jsonschema` for schemas, Python's
`re.fullmatch` for regexes, membership for choices."""

from __future__ import annotations

import json
import random
import re

import jsonschema

from kvpage import StructuredOutputsParams

WORDS = ["red", "green", "blue", "cyan", "north", "south", "alpha", "beta", "x", "yes", "no"]
KEYS = ["id", "name", "kind", "size", "tags", "ok", "meta", "level", "code", "note"]


def json_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 required properties, nothing else allowed."""
    keys = rng.sample(KEYS, rng.randint(1, 4))
    properties = {key: _property(rng, depth) for key in keys}
    return {
        "type": "object",
        "properties": properties,
        "required": keys,
        "additionalProperties": False,
    }


def _property(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "enum", "string", "boolean", "array"] + (["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        items = {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 3))}
        return {"type": "array", "items": items, "maxItems": rng.randint(0, 3)}
    return json_schema(rng, depth + 1)


def json_schemas(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [json_schema(rng) for _ in range(count)]


def _atom(rng: random.Random) -> str:
    low = rng.randint(0, 3)
    bound = f"{{{low},{low + rng.randint(1, 3)}}}" if low else f"{{1,{rng.randint(1, 4)}}}"
    pick = rng.randrange(5)
    if pick == 0:
        return f"[a-z]{bound}"
    if pick == 1:
        return f"[0-9]{bound}"
    if pick == 2:
        return f"[A-F0-9]{bound}"
    if pick == 3:
        return "(" + "|".join(rng.sample(WORDS, rng.randint(2, 4))) + ")"
    return re.escape(rng.choice(["-", "_", ":", "=", "/"]))


def regex(rng: random.Random) -> str:
    """2-4 atoms in a row, one of them optional now and then: e.g. [a-z]{1,4}(-[0-9]{1,3})?"""
    atoms = [_atom(rng) for _ in range(rng.randint(2, 4))]
    if rng.random() < 0.4:
        i = rng.randrange(len(atoms))
        atoms[i] = f"({atoms[i]})?"
    return "".join(atoms)


def regexes(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [regex(rng) for _ in range(count)]


def choice_lists(count: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [rng.sample(WORDS, rng.randint(2, 5)) for _ in range(count)]


def valid(params: StructuredOutputsParams, text: str, schema: dict | None = None) -> bool:
    """Does `text` satisfy the constraint, by a checker that is not the grammar engine?
    `schema`: the JSON schema as the test wrote it, validated instead of `params.json` (which
    StructuredOutputsParams normalized: a bug there would be in the constraint and the check)."""
    if params.kind == "regex":
        return re.fullmatch(params.regex, text) is not None
    if params.kind == "choice":
        return text in params.choice
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if params.kind == "json_object":
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, json.loads(params.json) if schema is None else schema)
    except jsonschema.ValidationError:
        return False
    return True
