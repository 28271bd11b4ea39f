"""What a request's output must match (vLLM's `StructuredOutputsParams`): a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a Lark grammar. Plain data, checked
here; kvpage.structured compiles it."""

from __future__ import annotations

import hashlib
import json as jsonlib
from dataclasses import dataclass

from kvpage.errors import InvalidRequest

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None  # the whole output matches it (Python `re.fullmatch`'s sense)
    choice: tuple[str, ...] | None = None  # the output is exactly one of these
    grammar: str | None = None  # a Lark grammar (llguidance's dialect), or GBNF
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    # JSON without whitespace between tokens (vLLM's name); by default JSON may have it
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"structured_outputs.{name} must be a non-empty string")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"structured_outputs.{name} must be true or false")
        chosen = [kind for kind in KINDS if self._value(kind) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequest(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(chosen) or 'none'}"
            )

    def _value(self, kind: str):
        return getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if self._value(kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the grammar, the choices as a
        JSON list ("" for json_object)."""
        value = self._value(self.kind)
        if self.kind == "choice":
            return jsonlib.dumps(list(value), ensure_ascii=False)
        return "" if value is True else value

    @property
    def digest(self) -> str:
        """The constraint's content, hashed: two requests with the same digest compile to the
        same grammar (whatever their schemas are named)."""
        text = f"{self.kind}\0{int(self.disable_any_whitespace)}\0{self.spec}".encode()
        return hashlib.sha256(text).hexdigest()

    @property
    def schema_name(self) -> str | None:
        """The schema's `title`, if any (what a client names it; never a cache key)."""
        if self.kind != "json":
            return None
        title = jsonlib.loads(self.json).get("title") if self.json.startswith("{") else None
        return title if isinstance(title, str) else None


def _schema_text(schema: str | dict) -> str:
    """The schema as compact JSON text, its key order kept (properties are generated in it)."""
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as err:
            raise InvalidRequest(f"structured_outputs.json is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("structured_outputs.json must be a JSON schema (an object)")
    return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _choices(choice) -> tuple[str, ...]:
    if isinstance(choice, str) or not all(isinstance(c, str) for c in choice):
        raise InvalidRequest("structured_outputs.choice must be a list of strings")
    choices = tuple(choice)
    if not choices or any(not c for c in choices):
        raise InvalidRequest(
            "structured_outputs.choice must be a non-empty list of non-empty strings"
        )
    return choices
