"""Structured outputs in generated scenarios: some requests get a small bounded constraint — a
JSON schema (an object of a few integer, boolean, enum and patterned-string properties, or a
short array of integers), a regex of a few pieces, or a choice among a few words — so every
check of the stage (the diff against the reference's own matcher, the masked sampling oracle,
the independent output checker) runs on constrained requests beside free ones, under whatever
the scenario draws around them (preemption, forks, aborts, prefix hits, kill switches).

Drawn on a stream of its own: the scenarios' other draws stay what they were. JSON is drawn
without free whitespace and every value is bounded, so a random model's output can end."""

from __future__ import annotations

import random

from kvpage.verify.generated.served import add_cover

P_CONSTRAINED = 0.25
P_ROOM = 0.6  # a constrained request given room to complete (else its drawn max_tokens)
KINDS = ("json", "regex", "choice")
# Enough for the longest output of each kind drawn here (two properties of an object, three
# regex pieces, one word) to complete.
ROOM = {"json": 28, "regex": 14, "choice": 8}
WORDS = ("red", "green", "blue", "yes", "no", "up", "down", "alpha", "beta", "x")
REGEX_PIECES = ("[a-f]{1,4}", "[0-9]{1,3}", "(ab|cd)", "[xyz]", "-", "(on|off)", "[A-C]{2}")


def draw_constraints(rng: random.Random, requests, covers: dict) -> None:
    """Give some of `requests` (not a timed one: only the clock may end it) a constraint, and
    most of those enough max_tokens to complete it."""
    for request in requests:
        if request.timeout_s is not None or rng.random() >= P_CONSTRAINED:
            continue
        kind = rng.choice(KINDS)
        request.structured = {"json": _json_schema, "regex": _regex, "choice": _choice}[kind](rng)
        if rng.random() < P_ROOM:
            request.max_tokens = max(request.max_tokens, ROOM[kind])
        add_cover(covers, "structured", kind)


def _json_schema(rng: random.Random) -> dict:
    if rng.random() < 0.25:
        items = {"type": "integer", "minimum": 0, "maximum": rng.choice((9, 99))}
        schema = {"type": "array", "items": items, "maxItems": rng.randint(1, 4)}
        return {"json": schema, "disable_any_whitespace": True}
    names = rng.sample(("a", "b", "id", "ok", "tag", "n"), rng.randint(1, 2))
    properties = {name: _property(rng) for name in names}
    schema = {
        "type": "object",
        "properties": properties,
        "required": names,
        "additionalProperties": False,
    }
    return {"json": schema, "disable_any_whitespace": True}


def _property(rng: random.Random) -> dict:
    kind = rng.choice(("integer", "boolean", "enum", "string"))
    if kind == "integer":
        low = rng.randint(-5, 5)
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice((3, 50, 900))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 3))}
    return {"type": "string", "pattern": f"^[a-z]{{1,{rng.randint(1, 4)}}}$"}


def _regex(rng: random.Random) -> dict:
    return {"regex": "".join(rng.choice(REGEX_PIECES) for _ in range(rng.randint(1, 3)))}


def _choice(rng: random.Random) -> dict:
    return {"choice": rng.sample(WORDS, rng.randint(2, 4))}
