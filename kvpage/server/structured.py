"""A request's output constraint (kvpage.structured_params), from the fields a client sends:
OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}`; `{"type": "text"}` is no constraint), vLLM's `structured_outputs`
(StructuredOutputsParams' fields) and, on chat, a `tool_choice` that forces a call
(kvpage.server.tool_calls). One source per request: two of them at once are a 400, never a
silent choice between them.

A constraint the grammar engine refuses (a schema, regex or grammar it cannot compile) is a 400
that names the field the client sent, raised before anything is streamed; the engine compiles at
add_request and keeps serving the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpage.errors import InvalidRequest
from kvpage.server.protocol import ApiError
from kvpage.structured_params import StructuredOutputsParams

# Every refused constraint's message ends so (tests/server/test_openapi.py spares a schema-valid
# request refused for it: no JSON Schema says which schemas or regexes a grammar engine compiles).
REFUSED = "(the grammar engine refuses this constraint)"


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match, and the request field it came from (errors name it)."""

    params: StructuredOutputsParams
    field: str  # response_format | structured_outputs | tool_choice
    where: str  # the place in the request that the engine's "structured_outputs.<kind>" means


def request_constraint(body: Any, tool_constraint: Constraint | None = None) -> Constraint | None:
    """The body's constraint (None: unconstrained). `tool_constraint`: what the chat's
    tool_choice forces, if it forces a call."""
    sources = [c for c in (_response_format(body), _structured_outputs(body), tool_constraint) if c]
    if len(sources) > 1:
        names = " and ".join(c.field for c in sources)
        raise ApiError(f"{names} both constrain the output: send one of them", sources[1].field)
    return sources[0] if sources else None


def _response_format(body: Any) -> Constraint | None:
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return constraint_from("response_format", "response_format", json_object=True)
    if fmt.json_schema is None:
        raise ApiError(
            'response_format: type "json_schema" needs a json_schema object', "response_format"
        )
    schema = fmt.json_schema.schema_
    where = "response_format.json_schema.schema"
    if schema is None:
        raise ApiError(f"{where} is required (the JSON schema to follow)", "response_format")
    return constraint_from("response_format", where, json=schema)


def _structured_outputs(body: Any) -> Constraint | None:
    fields = getattr(body, "structured_outputs", None)
    if fields is None:
        return None
    values = fields.model_dump(exclude_none=True, by_alias=True)
    return constraint_from("structured_outputs", "structured_outputs", **values)


def constraint_from(field: str, where: str, **values: Any) -> Constraint:
    try:
        params = StructuredOutputsParams(**values)
    except InvalidRequest as err:
        raise refusal(err, Constraint(None, field, where)) from err  # type: ignore[arg-type]
    return Constraint(params, field, where)


def is_constraint_error(err: InvalidRequest) -> bool:
    """The engine's refusal of a constraint (kvpage.structured.compiler names it so; an engine
    without a tokenizer says "structured outputs need ...")."""
    return str(err).startswith(("structured_outputs", "structured outputs"))


def refusal(err: InvalidRequest, constraint: Constraint) -> ApiError:
    """The engine's message about `structured_outputs.<kind>`, told as the field the client
    sent (`response_format.json_schema.schema: ...`), with `param` that field."""
    message = str(err)
    if constraint.where != "structured_outputs":
        head, sep, rest = message.partition(":")
        if sep and head.startswith("structured_outputs"):
            message = f"{constraint.where}:{rest}"
        elif message.startswith("structured_outputs.json "):  # "... is not valid JSON: ..."
            message = constraint.where + message.removeprefix("structured_outputs.json")
    return ApiError(f"{message} {REFUSED}", constraint.field)
