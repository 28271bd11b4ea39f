"""The server's OpenAPI document (`/openapi.json`), told as the server behaves.

FastAPI's own document is wrong for this server: it lists a 422 the server never sends (a
validation error is a 400 in OpenAI's error shape), none of the statuses it does send, `/metrics`
as JSON, no server-sent events and no response bodies. Here each operation's responses come from
one table (`OPERATIONS`), response bodies from another (`SCHEMAS`), and the request schemas are
tightened where the server refuses what pydantic's schema would allow (`_tighten`), so that the
document matches what the server accepts. tests/server/test_openapi.py holds the server to it.

The document is made per app: token ids are bounded by the served model's vocabulary, and the
credentials are those the server has set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvpage.sampling_params import SEED_MAX, SEED_MIN
from kvpage.server.batch import MAX_PROMPTS
from kvpage.server.protocol import MAX_N, MAX_STOP, MAX_STOP_CHARS, RENDER_ARGUMENTS, UNSUPPORTED

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    """An object with these properties, the first all required."""
    properties = {**required, **(optional or {})}
    return {"type": "object", "required": list(required), "properties": properties}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_INT, _NUM, _STR, _BOOL = (
    {"type": "integer"},
    {"type": "number"},
    {"type": "string"},
    {"type": "boolean"},
)


def _list(items: Schema) -> Schema:
    return {"type": "array", "items": items}


# --- response bodies ------------------------------------------------------------------------
_USAGE = _obj(
    {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _obj({"cached_tokens": _INT}),
    }
)
# vLLM's prompt_logprobs: None for the first prompt token, then {token id: its entry}
_PROMPT_LOGPROBS = _nullable(
    _list(
        _nullable(
            {
                "type": "object",
                "additionalProperties": _obj(
                    {"logprob": _NUM, "rank": _nullable(_INT), "decoded_token": _STR}
                ),
            }
        )
    )
)
_FINISH = _nullable(
    {"type": "string", "enum": ["stop", "length", "abort", "timeout", "error", "tool_calls"]}
)
_COMPLETION_LOGPROBS = _obj(
    {
        "tokens": _list(_STR),
        "token_logprobs": _list(_nullable(_NUM)),  # None: an echoed prompt's first token
        "top_logprobs": _list(_nullable({"type": "object", "additionalProperties": _NUM})),
        "text_offset": _list(_INT),
    }
)
_CHAT_TOKEN = {"token": _STR, "logprob": _NUM, "bytes": _nullable(_list(_INT))}
_CHAT_LOGPROBS = _obj(
    {"content": _list(_obj({**_CHAT_TOKEN, "top_logprobs": _list(_obj(_CHAT_TOKEN))}))}
)
_EXTRAS = {"token_ids": _list(_INT), "prompt_logprobs": _PROMPT_LOGPROBS}  # when asked for


def _envelope(obj: str, choice: Schema, final: bool, extra: Schema | None = None) -> Schema:
    """A completion (final) or a stream chunk: chunks carry `usage` only with include_usage
    (null until the last), and the usage chunk has no choices."""
    head = {"id": _STR, "object": {"const": obj}, "created": _INT, "model": _STR}
    body = {**head, "choices": _list(choice)}
    if final:
        return _obj({**body, "usage": _USAGE}, extra)
    return _obj(body, {"usage": _nullable(_USAGE), **(extra or {})})


_COMPLETION_CHOICE = _obj(
    {
        "index": _INT,
        "text": _STR,
        "logprobs": _nullable(_COMPLETION_LOGPROBS),
        "finish_reason": _FINISH,
    },
    _EXTRAS,
)
# a reply read as tool calls (kvpage.server.tool_calls): content null when there are only calls
_TOOL_CALL = _obj(
    {"id": _STR, "type": {"const": "function"}, "function": _obj({"name": _STR, "arguments": _STR})}
)
_CHAT_MESSAGE = _obj(
    {"role": {"const": "assistant"}, "content": _nullable(_STR)}, {"tool_calls": _list(_TOOL_CALL)}
)
# a streamed call: its first delta has id, type and name (arguments ""), then argument fragments
_TOOL_CALL_DELTA = _obj(
    {"index": _INT, "function": _obj({}, {"name": _STR, "arguments": _STR})},
    {"id": _STR, "type": {"const": "function"}},
)
_CHAT_CHOICE = _obj(
    {
        "index": _INT,
        "message": _CHAT_MESSAGE,
        "logprobs": _nullable(_CHAT_LOGPROBS),
        "finish_reason": _FINISH,
    },
    {"token_ids": _list(_INT)},
)
# A chat chunk's first delta per choice carries the role, and no logprobs.
_CHAT_DELTA = _obj(
    {
        "index": _INT,
        "delta": _obj(
            {},
            {
                "role": {"const": "assistant"},
                "content": _STR,
                "tool_calls": _list(_TOOL_CALL_DELTA),
            },
        ),
        "finish_reason": _FINISH,
    },
    {"logprobs": _nullable(_CHAT_LOGPROBS), "token_ids": _list(_INT)},
)
_PROMPT_EXTRA = {"prompt_logprobs": _PROMPT_LOGPROBS}
_ERROR_DETAIL = _obj(
    {
        "message": _STR,
        # invalid_request_error, authentication_error, permission_error, not_found_error,
        # service_unavailable, server_error
        "type": _STR,
        "param": _nullable(_STR),  # the request field at fault, when there is one
        "code": _nullable(_STR),
    }
)


def _events(chunk: str) -> Schema:
    """One server-sent event of a stream: a chunk, an error (the engine failed mid-stream), or
    the final `[DONE]`. Schemathesis reads a text/event-stream `schema` as the schema of one
    parsed event ({data, event, id, retry}); `data` is JSON but for `[DONE]`."""
    json_data = {
        "type": "string",
        "not": {"const": "[DONE]"},
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]},
    }
    return _obj({"data": {"anyOf": [{"const": "[DONE]"}, json_data]}})


_CARD = _obj(
    {
        "id": _STR,
        "object": {"const": "model"},
        "created": _INT,
        "owned_by": _STR,
        "root": _STR,
        "max_model_len": _INT,
    },
    {"parent": _STR},  # an adapter's card: the base model it applies to
)
_SWITCHED = {  # what each switch answers: the switch's new state
    "PrefixCachingSwitched": _obj(
        {"prefix_caching": _BOOL, "scope": {"enum": ["global", "namespace"]}},
        {"namespace": _STR, "tenant": _nullable(_STR)},  # scope namespace: its digest, tenant
    ),
    "PreemptionSwitched": _obj({"preemption": _BOOL}),
    "DrainSwitched": _obj({"draining": _BOOL}),
    "LoraLoaded": _obj({"lora_name": _STR, "loaded": {"const": True}, "digest": _STR}),
    "LoraUnloaded": _obj({"lora_name": _STR, "loaded": {"const": False}}),
}
SCHEMAS: dict[str, Schema] = {
    "Error": _obj({"error": _ERROR_DETAIL}),
    "Health": _obj({"status": {"enum": ["ok", "draining"]}, "draining": _BOOL}),
    "ModelCard": _CARD,
    "ModelList": _obj({"object": {"const": "list"}, "data": _list(_ref("ModelCard"))}),
    "Completion": _envelope("text_completion", _COMPLETION_CHOICE, final=True),
    "CompletionChunk": _envelope("text_completion", _COMPLETION_CHOICE, final=False),
    "CompletionEvent": _events("CompletionChunk"),
    "ChatCompletion": _envelope("chat.completion", _CHAT_CHOICE, True, _PROMPT_EXTRA),
    "ChatCompletionChunk": _envelope("chat.completion.chunk", _CHAT_DELTA, False, _PROMPT_EXTRA),
    "ChatCompletionEvent": _events("ChatCompletionChunk"),
    "Tokenized": _obj(
        {
            "count": _INT,
            "max_model_len": _INT,
            "tokens": _list(_INT),
            "token_strs": _nullable(_list(_STR)),  # with return_token_strs
        }
    ),
    "Detokenized": _obj({"prompt": _STR}),
    **_SWITCHED,
    # the engine's counters (all integers), and the server's own
    "AdminStats": {
        **_obj({"num_blocks": _INT, "draining": _BOOL, "shadow_checks": _INT}),
        "additionalProperties": _INT,
    },
    "AdminAudit": _obj({"events": _list({"type": "object"})}),
}

# --- responses ------------------------------------------------------------------------------
# Why each error status is sent; every one has the Error body.
ERRORS: dict[int, str] = {
    400: "Invalid request: the body is not JSON, fails validation, or asks for what the server "
    "refuses (`param` names the field)",
    401: "Missing or invalid credentials (the API key, or X-Admin-Token on /admin)",
    403: "The admin API is disabled (the server has no admin token)",
    404: "No such model",
    413: "The request body is larger than the server's limit",
    500: "Internal error, or the engine failed",
    503: "The server is draining (or shut down before the request finished)",
}
_EVERYWHERE = (413, 500)  # any request's body is bounded; any route can fail
_KEYED = (401, *_EVERYWHERE)  # an API key may be needed
_WITH_BODY = (400, 404, *_KEYED)  # a JSON body naming a model
_ADMIN = (401, 403, *_EVERYWHERE)


_KEY, _TOKEN = "ApiKey", "AdminToken"
# The credentials, as security schemes; each is declared only where the server has it set (API
# keys, an admin token): an open server's routes need nothing, and a server without an admin
# token answers 403 on /admin whatever is sent.
SECURITY: dict[str, Schema] = {
    _KEY: {"type": "http", "scheme": "bearer", "description": "an API key"},
    _TOKEN: {"type": "apiKey", "in": "header", "name": "X-Admin-Token"},
}
_CREDENTIAL_HEADERS = {"authorization", "x-admin-token"}  # what FastAPI's Header() declared


@dataclass(frozen=True, slots=True)
class Operation:
    success: str  # the 200 body's schema
    errors: tuple[int, ...]  # the error statuses it sends, each with the Error body
    stream: str | None = None  # with `stream: true`: one event's schema (text/event-stream)
    text: bool = False  # the 200 body is Prometheus text
    credential: str | None = None  # what it needs when the server has it set (SECURITY)
    # statuses with a body of their own, not Error: /health's 503 is read by load balancers
    own: tuple[tuple[int, str, str], ...] = ()  # (status, description, schema)


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/health", "get"): Operation("Health", _EVERYWHERE, own=((503, "Draining", "Health"),)),
    ("/metrics", "get"): Operation("", _EVERYWHERE, text=True),
    ("/v1/models", "get"): Operation("ModelList", _KEYED, credential=_KEY),
    ("/v1/models/{model_id}", "get"): Operation("ModelCard", (404, *_KEYED), credential=_KEY),
    ("/v1/completions", "post"): Operation(
        "Completion", (503, *_WITH_BODY), "CompletionEvent", credential=_KEY
    ),
    ("/v1/chat/completions", "post"): Operation(
        "ChatCompletion", (503, *_WITH_BODY), "ChatCompletionEvent", credential=_KEY
    ),
    ("/tokenize", "post"): Operation("Tokenized", _WITH_BODY, credential=_KEY),
    ("/detokenize", "post"): Operation("Detokenized", _WITH_BODY, credential=_KEY),
    ("/admin/prefix-caching", "post"): Operation(
        "PrefixCachingSwitched", (400, *_ADMIN), credential=_TOKEN
    ),
    ("/admin/preemption", "post"): Operation(
        "PreemptionSwitched", (400, *_ADMIN), credential=_TOKEN
    ),
    ("/admin/drain", "post"): Operation("DrainSwitched", (400, *_ADMIN), credential=_TOKEN),
    ("/admin/stats", "get"): Operation("AdminStats", _ADMIN, credential=_TOKEN),
    ("/admin/audit", "get"): Operation("AdminAudit", _ADMIN, credential=_TOKEN),
    ("/v1/load_lora_adapter", "post"): Operation("LoraLoaded", (400, *_ADMIN), credential=_TOKEN),
    ("/v1/unload_lora_adapter", "post"): Operation(
        "LoraUnloaded", (400, 404, *_ADMIN), credential=_TOKEN
    ),
}


_CHAT = [{"role": "user", "content": "Hello"}]
_TOOL = {  # shown to the model by its chat template; tool_choice may force a call of it
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
_SCHEMA = {  # a JSON schema for response_format and structured_outputs
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}},
    "required": ["answer"],
}
# Request bodies a reader can start from (and schemathesis sends first): one of each shape.
EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/completions", "post"): {
        "text": {"prompt": "Once upon a time", "max_tokens": 8},
        "stream": {
            "prompt": "Once",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "batch": {"prompt": ["Once", "Twice"], "max_tokens": 2, "logprobs": 2, "echo": True},
        "regex": {"prompt": "Code:", "max_tokens": 8, "structured_outputs": {"regex": "[A-Z]{3}"}},
        "batch_stream": {"prompt": [[72, 105], [79]], "max_tokens": 2, "stream": True, "n": 2},
        "scored": {"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": 1, "return_token_ids": True},
    },
    ("/v1/chat/completions", "post"): {
        "chat": {"messages": _CHAT, "max_completion_tokens": 8},
        "stream": {
            "messages": _CHAT,
            "max_tokens": 4,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
        "scored": {
            "messages": _CHAT,
            "max_tokens": 1,
            "prompt_logprobs": 1,
            "return_token_ids": True,
        },
        "tools": {
            "messages": _CHAT,
            "max_tokens": 16,
            "tools": [_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        "json_schema": {
            "messages": _CHAT,
            "max_tokens": 16,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": _SCHEMA, "strict": True},
            },
        },
        "choice": {
            "messages": _CHAT,
            "max_tokens": 4,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    },
    ("/tokenize", "post"): {
        "prompt": {"prompt": "Hello"},
        "messages": {"messages": _CHAT, "return_token_strs": True},
    },
    ("/detokenize", "post"): {"tokens": {"tokens": [72, 105]}},
    ("/admin/prefix-caching", "post"): {
        "global": {"enabled": False},
        "namespace": {"enabled": False, "cache_salt": "team-a"},
    },
    ("/admin/preemption", "post"): {"off": {"enabled": False}},
    ("/admin/drain", "post"): {"on": {"enabled": True}},
    ("/v1/load_lora_adapter", "post"): {"load": {"lora_name": "sql", "lora_path": "/adapters/sql"}},
    ("/v1/unload_lora_adapter", "post"): {"unload": {"lora_name": "sql"}},
}


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def responses(op: Operation) -> dict[str, Schema]:
    """The operation's responses object: its success, then each error status it sends."""
    if op.text:
        content: Schema = {"text/plain": {"schema": _STR}}
    else:
        content = _json(_ref(op.success))
    if op.stream:
        content["text/event-stream"] = {"schema": _ref(op.stream)}
    ok = "OK" + (" (text/event-stream when the request sets stream: true)" if op.stream else "")
    out = {"200": {"description": ok, "content": content}}
    for status in sorted(op.errors):
        out[str(status)] = {"description": ERRORS[status], "content": _json(_ref("Error"))}
    for status, description, schema in op.own:
        out[str(status)] = {"description": description, "content": _json(_ref(schema))}
    return dict(sorted(out.items()))


# --- request bodies -------------------------------------------------------------------------
def _token_ids(vocab: int) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": vocab - 1}


def _prompt(vocab: int) -> Schema:
    """A prompt is never empty: a string, token ids, or a batch of up to MAX_PROMPTS of either."""
    text, ids = {"type": "string", "minLength": 1}, {**_list(_token_ids(vocab)), "minItems": 1}
    batch = {"minItems": 1, "maxItems": MAX_PROMPTS}
    return {"anyOf": [text, ids, {**_list(text), **batch}, {**_list(ids), **batch}]}


def _stop() -> Schema:
    one = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return _nullable({"anyOf": [one, {**_list(one), "maxItems": MAX_STOP}]})


def _off(values: tuple[Any, ...]) -> Schema:
    """An unsupported field (protocol.UNSUPPORTED): accepted only absent, null, or "off"."""
    return {"enum": [None, *values]}


def _common(vocab: int) -> dict[str, Schema]:
    """What both generation endpoints refuse beyond pydantic's types."""
    zero = {"type": "number", "minimum": 0, "maximum": 0}  # penalties are not implemented
    return {
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "top_k": {"anyOf": [{"const": -1}, {"minimum": 1, "maximum": vocab}], "type": "integer"},
        "seed": _nullable({"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}),
        "stop": _stop(),
        "stop_token_ids": {**_list(_token_ids(vocab)), "maxItems": 1024},
        "presence_penalty": zero,
        "frequency_penalty": zero,
        **{name: _off(off) for name, off in UNSUPPORTED.items()},
    }


def _chat_template(names: list[str]) -> dict[str, Schema]:
    """A request's `chat_template` names one of the served model's templates; its
    chat_template_kwargs may not set what the request has fields for (kvpage.server.chat)."""
    reserved = {"not": {"enum": sorted(RENDER_ARGUMENTS)}}
    kwargs = {"type": "object", "propertyNames": reserved}
    return {
        "chat_template": {"enum": [None, *names]},
        "chat_template_kwargs": _nullable(kwargs),
    }


def _tighten(schemas: dict[str, Schema], vocab: int, names: list[str], auto_tools: bool) -> None:
    """Request schemas as the server accepts them (pydantic's say only the types); `names`: the
    served model's chat templates; `auto_tools`: tool_choice "auto" is served."""
    fields = {
        "CompletionRequest": {
            **_common(vocab),
            "prompt": _prompt(vocab),
            "echo": _BOOL,
            "best_of": {"anyOf": [{"type": "null"}, {"type": "integer", "const": 1}]},
            "suffix": {"enum": [None, ""]},
        },
        "ChatCompletionRequest": {
            **_common(vocab),
            **_chat_template(names),
            "tool_choice": _tool_choice(auto_tools),
        },
        "DetokenizeRequest": {"tokens": {**_list(_token_ids(vocab)), "maxItems": 1_000_000}},
        "TokenizeRequest": _chat_template(names),
    }
    for model, props in fields.items():
        schemas[model]["properties"].update(props)
    for model, rules in _RULES.items():
        schemas[model]["allOf"] = rules
    _tighten_constraints(schemas)
    schemas["TokenizeRequest"]["oneOf"] = [_only("prompt", "messages"), _only("messages", "prompt")]


def _needs(field: str, value: Schema, needed: str, needed_value: Any) -> Schema:
    """A field given `value` needs another field set to `needed_value`."""
    return {
        "if": {"required": [field], "properties": {field: value}},
        "then": {"required": [needed], "properties": {needed: {"const": needed_value}}},
    }


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_TEXT = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]}


def _chosen(kind: str) -> Schema:
    """structured_outputs with `kind` the one constraint set (the others null, absent, false)."""
    off = {k: {"enum": [None, False]} for k in _CONSTRAINT_KINDS if k != kind}
    on = {"const": True} if kind == "json_object" else {"not": {"type": "null"}}
    return {"required": [kind], "properties": {kind: on, **off}}


def _tighten_constraints(schemas: dict[str, Schema]) -> None:
    """structured_outputs takes exactly one constraint, non-empty; a json_schema
    response_format needs its schema (kvpage.server.structured)."""
    fields = schemas["StructuredOutputsField"]
    fields["properties"].update(
        regex=_TEXT,
        grammar=_TEXT,
        choice=_nullable({**_list({"type": "string", "minLength": 1}), "minItems": 1}),
        json=_nullable({"anyOf": [{"type": "object"}, _STR, {"const": True}]}),
    )
    fields["oneOf"] = [_chosen(kind) for kind in _CONSTRAINT_KINDS]
    needs_schema = _obj({"schema": {"type": "object"}})
    schemas["ResponseFormat"]["allOf"] = [
        {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": needs_schema}},
        }
    ]


def _tool_choice(auto_tools: bool) -> Schema:
    modes = ["none", "required", *(["auto"] if auto_tools else [])]
    return {"anyOf": [{"enum": modes}, _ref("NamedToolChoice"), {"type": "null"}]}


# response_format and structured_outputs: not both at once. (tool_choice's own rules, that a
# forced call needs tools in OpenAI's function shape and no second constraint, are in the
# description: schemathesis' canonicaliser cannot model the chat request with them as well.)
_TEXT_FORMAT = _nullable(_obj({"type": {"const": "text"}}))
_ONE_CONSTRAINT = {
    "anyOf": [
        {"properties": {"structured_outputs": {"type": "null"}}},
        {"properties": {"response_format": _TEXT_FORMAT}},
    ]
}

_STREAM_OPTIONS = _needs("stream_options", {"type": "object"}, "stream", True)
# the final message is continued, so no new one is begun (transformers refuses both)
_CONTINUE = _needs("continue_final_message", {"const": True}, "add_generation_prompt", False)
# Rules across fields, as the models' check_unsupported methods apply them.
_RULES: dict[str, list[Schema]] = {
    "CompletionRequest": [
        _STREAM_OPTIONS,
        _needs("max_tokens", {"const": 0}, "echo", True),
        _ONE_CONSTRAINT,
    ],
    "ChatCompletionRequest": [
        _STREAM_OPTIONS,
        _ONE_CONSTRAINT,
        _needs("top_logprobs", {"type": "integer"}, "logprobs", True),
        _CONTINUE,
    ],
    "TokenizeRequest": [_CONTINUE],
}


def _only(present: str, absent: str) -> Schema:
    """/tokenize takes exactly one of prompt and messages (null counts as absent)."""
    return {
        "required": [present],
        "properties": {present: {"not": {"type": "null"}}, absent: {"type": "null"}},
    }


DESCRIPTION = """\
OpenAI-compatible completions and chat completions (with vLLM's extensions), tokenizer routes,
health, Prometheus metrics and the admin switches.

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`; an invalid request is a
400 (never a 422), and `param` names the field at fault. Integers are JSON integers: where one is
expected, `2.0` is refused, as is `true`; token ids (`prompt`, `stop_token_ids`, /detokenize
`tokens`) are the exception, where `450.0` is token 450, as JSON Schema's integers include it.
Some refusals depend on the served model and are not
written in the schemas: the prompt's tokens plus `max_tokens` must fit the context (`max_model_len`
in /v1/models) and the KV pool, and `seed + n - 1` must fit in 64 bits.

Output constraints: `response_format` (`json_object`, `json_schema`) or vLLM's
`structured_outputs` (exactly one of json, regex, choice, grammar, json_object); a schema, regex or
grammar the grammar engine cannot compile is a 400 naming the field. `tool_choice` "required" or a
named function (chat) forces a call: it needs `tools` in OpenAI's function shape, a named function
must be one of them, and neither goes with another constraint; "auto" is served only with
`--enable-auto-tool-choice --tool-call-parser hermes`.

With `stream: true` the answer is `text/event-stream`; its schema is that of one event, whose
`data` is a JSON chunk (or an error, if the engine fails mid-stream), and the last event's is
`[DONE]`."""


def document(app: FastAPI) -> Schema:
    """The OpenAPI document: FastAPI's, with the responses, credentials and request schemas
    fixed, for this app's model and options."""
    state = app.state.server
    doc = get_openapi(
        title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes
    )
    required = {_KEY: state.tenants.enabled, _TOKEN: state.options.admin_token is not None}
    for (path, method), op in OPERATIONS.items():
        item = doc["paths"][path][method]
        item["responses"] = responses(op)
        _credentials(item, op, required)
    doc["components"]["securitySchemes"] = {k: v for k, v in SECURITY.items() if required[k]}
    for (path, method), examples in EXAMPLES.items():
        body = doc["paths"][path][method]["requestBody"]["content"]["application/json"]
        body["examples"] = {name: {"value": value} for name, value in examples.items()}
    schemas = doc["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):  # only FastAPI's 422 used them
        schemas.pop(unused, None)
    names = sorted(state.chat_template.compiled)
    auto_tools = state.options.auto_tool_parser is not None
    _tighten(schemas, state.loop.engine.model.config.vocab_size, names, auto_tools)
    schemas.update(SCHEMAS)
    return doc


def _credentials(item: Schema, op: Operation, required: dict[str, bool]) -> None:
    """Credentials as security requirements, not header parameters (OpenAPI ignores one named
    Authorization, and an open server ignores the header altogether)."""
    params = [p for p in item.get("parameters", []) if p["name"] not in _CREDENTIAL_HEADERS]
    if params:
        item["parameters"] = params
    else:
        item.pop("parameters", None)
    if op.credential is not None and required[op.credential]:
        item["security"] = [{op.credential: []}]


def install(app: FastAPI) -> None:
    """Serve `document` as /openapi.json (made once, on first request)."""

    def openapi() -> Schema:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
