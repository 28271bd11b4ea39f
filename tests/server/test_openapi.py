"""/openapi.json tells the truth (issue 23 item 6): each route declares every status it sends, with
its body; validation errors are 400s (never FastAPI's 422); /metrics is text; streams are
text/event-stream. Checked two ways: probe calls whose answers must all be declared, and a bounded
schemathesis run (every check) against a live server on a small context."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from schemathesis.config import SchemathesisConfig

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from .conftest import MODEL
from .schema_fuzz import beyond_schema

ADMIN = "admin-secret"
KEY = "key-alice"
CONTEXT = 64  # a small context, so that no fuzzed request generates more than 64 tokens a sample


@dataclass
class Apps:
    """`open`: no API keys, an admin token; `locked`: an API key, no admin token."""

    open: str
    locked: str
    doc: dict  # the open server's
    locked_doc: dict


def _app(api_keys: dict[str, str], admin_token: str | None):
    engine = LLMEngine(
        EngineConfig(model=MODEL, num_blocks=64, max_num_seqs=16, max_model_len=CONTEXT)
    )
    options = ServerOptions(
        model_name=MODEL,
        api_keys=api_keys,
        admin_token=admin_token,
        shadow_rate=0.0,
        max_body_bytes=64 * 1024,
    )
    return create_app(engine, options)


@pytest.fixture(scope="module")
def apps() -> Iterator[Apps]:
    with (
        BackgroundServer(_app({}, ADMIN)) as open_bg,
        BackgroundServer(_app({KEY: "alice"}, None)) as locked_bg,
    ):
        doc = httpx.get(f"{open_bg.url}/openapi.json", timeout=30).json()
        locked_doc = httpx.get(f"{locked_bg.url}/openapi.json", timeout=30).json()
        yield Apps(open_bg.url, locked_bg.url, doc, locked_doc)


# --- the document's structure ---------------------------------------------------------------
def _operations(doc: dict) -> Iterator[tuple[str, str, dict]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield path, method, op


def test_no_422_and_every_error_in_openai_shape(apps):
    for path, method, op in _operations(apps.doc):
        assert "422" not in op["responses"], (method, path)
        ok = op["responses"]["200"]["content"]
        assert all(media["schema"] for media in ok.values()), (method, path)  # none left as {}
        for status, response in op["responses"].items():
            content = response["content"]
            assert content, (method, path, status)
            if int(status) >= 400 and (path, status) != ("/health", "503"):  # Health's own body
                assert content == {"application/json": {"schema": _ref("Error")}}, (path, status)
    error = apps.doc["components"]["schemas"]["Error"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in apps.doc["components"]["schemas"]


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def test_metrics_is_text_and_streams_are_sse(apps):
    paths = apps.doc["paths"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path
    assert "text/event-stream" not in paths["/tokenize"]["post"]["responses"]["200"]["content"]


def test_request_schemas_refuse_what_the_server_refuses(apps):
    schemas = apps.doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    assert all(alt.get("minItems") == 1 for alt in prompt[1:])
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 16


def test_credentials_are_those_the_server_has(apps):
    """The open server has an admin token and no API keys; the locked one the other way round."""
    keyed = ("/v1/", "/tokenize", "/detokenize")  # the routes that take an API key
    admin = ("/admin/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # the admin token
    for doc, scheme, paths in [
        (apps.doc, "AdminToken", admin),
        (apps.locked_doc, "ApiKey", keyed),
    ]:
        assert list(doc["components"]["securitySchemes"]) == [scheme]
        for path, method, op in _operations(doc):
            takes = path.startswith(paths) and (
                scheme == "AdminToken" or not path.startswith(admin)
            )
            wanted = [{scheme: []}] if takes else None
            assert op.get("security") == wanted, (method, path)
            names = {p["name"].lower() for p in op.get("parameters", [])}
            assert not names & {"authorization", "x-admin-token"}, (method, path)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"content-type": "application/json"}
# (server, method, path, request arguments, the status the server answers)
PROBES = [
    ("open", "GET", "/health", {}, 200),
    ("open", "GET", "/metrics", {}, 200),
    ("open", "GET", "/v1/models", {}, 200),
    ("open", "GET", "/v1/models/nope", {}, 404),
    ("open", "POST", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}}, 200),
    ("open", "POST", "/v1/completions", {"json": {"prompt": "hi", "stream": True}}, 200),
    ("open", "POST", "/v1/completions", {"json": {"prompt": ""}}, 400),
    ("open", "POST", "/v1/completions", {"json": {"prompt": "hi", "model": "x"}}, 404),
    ("open", "POST", "/v1/completions", {"content": b"x" * 70_000}, 413),
    ("open", "POST", "/v1/chat/completions", {"json": CHAT}, 200),
    ("open", "POST", "/v1/chat/completions", {"json": {**CHAT, "stream": True}}, 200),
    ("open", "POST", "/v1/chat/completions", {"json": {**CHAT, "n": 0}}, 400),
    ("open", "POST", "/tokenize", {"json": {"prompt": "hi"}}, 200),
    ("open", "POST", "/tokenize", {"json": {}}, 400),
    ("open", "POST", "/tokenize", {"content": b'{"prompt": "\\ud800"}', "headers": JSON}, 400),
    ("open", "POST", "/detokenize", {"json": {"tokens": [1, 2]}}, 200),
    ("open", "POST", "/detokenize", {"json": {"tokens": [-1]}}, 400),
    ("open", "GET", "/admin/stats", {}, 401),
    ("open", "GET", "/admin/stats", {"headers": {"x-admin-token": ADMIN}}, 200),
    ("open", "GET", "/admin/audit", {"headers": {"x-admin-token": ADMIN}}, 200),
    ("open", "POST", "/admin/preemption", {"json": {"enabled": True}}, 401),
    ("locked", "GET", "/v1/models", {}, 401),
    ("locked", "POST", "/v1/completions", {"json": {"prompt": "hi"}}, 401),
    ("locked", "POST", "/tokenize", {"json": {"prompt": "hi"}}, 401),
    ("locked", "GET", "/admin/stats", {"headers": {"x-admin-token": ADMIN}}, 403),
    ("locked", "GET", "/health", {"content": b"x" * 70_000}, 413),
]


def test_every_status_the_server_sends_is_declared(apps):
    for server, method, path, kwargs, status in PROBES:
        r = httpx.request(method, f"{getattr(apps, server)}{path}", timeout=60, **kwargs)
        assert r.status_code == status, (method, path, r.text)
        template = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
        declared = apps.doc["paths"][template][method.lower()]["responses"]
        assert str(status) in declared, (method, path, status)
        media_type = r.headers["content-type"].split(";")[0]
        assert media_type in declared[str(status)]["content"], (method, path, media_type)


def test_drain_answers_503_as_declared(apps):
    admin = {"x-admin-token": ADMIN}
    url = apps.open
    assert httpx.post(f"{url}/admin/drain", json={"enabled": True}, headers=admin).is_success
    try:
        for method, path, body in [
            ("GET", "/health", None),
            ("POST", "/v1/completions", {"prompt": "x"}),
        ]:
            r = httpx.request(method, f"{url}{path}", json=body, timeout=30)
            assert r.status_code == 503, (path, r.text)
            assert "503" in apps.doc["paths"][path][method.lower()]["responses"]
    finally:
        httpx.post(f"{url}/admin/drain", json={"enabled": False}, headers=admin)


# --- schemathesis ---------------------------------------------------------------------------
# Every check schemathesis has (its default), on schema-valid and schema-violating data, in its
# examples, coverage and fuzzing phases. Few examples per operation, so that the run stays well
# under a minute on a loaded 2-core machine (the coverage phase's fixed cases are most of it).
# Of the checks, the stateful ones (use_after_free, ensure_resource_availability) need links
# between operations, which this API has none of; ignored_auth runs on /admin (the fuzzed server
# has an admin token and no API keys).
MAX_EXAMPLES = 8
CONFIG = f"""
[generation]
max-examples = {MAX_EXAMPLES}
deterministic = true  # the same cases on every run: a failure here is never a flake

[output.sanitization]
enabled = false  # nothing here is secret, and a failure should show what was sent

# schemathesis' own list, and 413: a schema-violating body past the server's size limit (a tools
# list over maxItems) is refused for its size before it is parsed, as every route declares
[checks.negative_data_rejection]
expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, "5xx"]
"""


@pytest.fixture(scope="module")
def api_schema(apps):
    config = SchemathesisConfig.from_str(CONFIG)
    return schemathesis.openapi.from_url(f"{apps.open}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def _nodeid_for_schemathesis(request) -> None:
    """schemathesis 4.32.5's `from_fixture` reads (and rewrites, to name each operation in its
    report) `Function._nodeid`, which pytest 9.2 no longer has: give it the node's id."""
    request.node._nodeid = request.node.nodeid


@pytest.mark.schemathesis
@pytest.mark.usefixtures("_nodeid_for_schemathesis")
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_server_conforms_to_its_document(case, apps):
    admin = case.operation.path.startswith("/admin/")
    # A made-up X-Admin-Token can only be a 401 (the probes above check it): send the real one,
    # so that the switches' bodies are checked too.
    headers = {"x-admin-token": ADMIN} if admin else None
    response = case.call(headers=headers, timeout=60)
    try:
        spared = beyond_schema(case, response, BEYOND_SCHEMA)
        excluded = [positive_data_acceptance] if spared else []
        case.validate_response(response, headers=headers, excluded_checks=excluded)
    finally:
        if case.operation.path == "/admin/drain":  # every case starts on a server not draining
            httpx.post(f"{apps.open}/admin/drain", json={"enabled": False}, headers=headers)


# Refusals of schema-valid requests that no JSON Schema can state, by what the 400 says. Such a
# request is spared positive_data_acceptance alone; every other check still runs on it.
BEYOND_SCHEMA = (
    # the prompt's tokens (and max_tokens) against the context or the KV pool: a count made by
    # the tokenizer and the chat template, not a length of the request's text
    "the model's context",
    "KV blocks; the pool has only",
    "(a 64-bit seed; seed + n - 1 too)",  # seed + n - 1 must fit: arithmetic across fields
    "unknown tenant",  # the tenants' names are not published in the document
    # continue_final_message needs text in the last message: JSON Schema cannot single it out
    "continue_final_message: the final message has no content",
    # which schemas, regexes and grammars the grammar engine compiles (kvpage.server.structured)
    "(the grammar engine refuses this constraint)",
    "which does not match any of the tools",  # tool_choice's function, by name among the tools
    "define $defs",  # two tools' $defs of one name that differ (tool_choice "required")
    # tool_choice's rules across fields (the document's description states them): JSON Schema
    # could, but schemathesis' canonicaliser gives up on the chat request with them written in
    "tool_choice needs tools",
    'a tool is {"type": "function"',
    "must be a JSON schema object",
    "both constrain the output: send one of them",
)
