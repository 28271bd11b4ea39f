"""The Ray-free pieces of `kvpage serve --replicas`: the ingress's routing key, the per-call ASGI
bridge a replica runs its app through, and the metrics merge. No Ray is started here."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model.tokenizer import ByteTokenizer
from kvpage.serve_replicas.asgi_call import HttpCall, ResponseStart, call_asgi
from kvpage.serve_replicas.metrics_merge import merge
from kvpage.serve_replicas.routing_key import UNROUTED, RoutingKeys
from kvpage.server import ServerOptions, create_app
from kvpage.server.chat import simple_template
from kvpage.server.tenants import Tenants

MODEL = "builtin:tiny-llama"
KEYS = {"key-alice": "alice", "key-bob": "bob"}


def _keys(api_keys: dict[str, str]) -> RoutingKeys:
    return RoutingKeys(Tenants(dict(api_keys)), ByteTokenizer(), simple_template)


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


# --- routing key ---------------------------------------------------------------------------
def test_key_is_the_tenant_and_the_prompt_the_engine_will_see():
    keys, tok = _keys(KEYS), ByteTokenizer()
    key = keys.key("/v1/completions", "Bearer key-bob", _body(prompt="hello"))
    assert (key.namespace, key.tokens) == ("tenant:bob", tuple(tok.encode("hello")))
    messages = [{"role": "user", "content": "hi"}]
    chat = keys.key("/v1/chat/completions", "Bearer key-alice", _body(messages=messages))
    assert chat.tokens == tuple(tok.encode(simple_template(messages)))
    ids = keys.key("/v1/completions", "Bearer key-alice", _body(prompt=[[5, 6, 7]]))
    assert ids.tokens == (5, 6, 7)


def test_a_batch_of_prompts_goes_where_its_first_prompt_does():
    keys, tok = _keys(KEYS), ByteTokenizer()
    key = keys.key("/v1/completions", "Bearer key-bob", _body(prompt=["hello", "other"]))
    assert (key.namespace, key.tokens) == ("tenant:bob", tuple(tok.encode("hello")))


def test_open_server_partitions_by_cache_salt():
    keys = _keys({})
    salted = keys.key("/v1/completions", None, _body(prompt="x", cache_salt="s1"))
    plain = keys.key("/v1/completions", None, _body(prompt="x"))
    assert (salted.namespace, plain.namespace) == ("salt:s1", "open")


def test_an_adapter_has_its_own_routing_namespace():
    keys = RoutingKeys(Tenants(dict(KEYS)), ByteTokenizer(), simple_template, frozenset({"base"}))
    base = keys.key("/v1/completions", "Bearer key-bob", _body(prompt="x", model="base"))
    adapter = keys.key("/v1/completions", "Bearer key-bob", _body(prompt="x", model="sql"))
    assert base.namespace == "tenant:bob"
    assert adapter.namespace == "tenant:bob|adapter:3:sql" and adapter.tokens == base.tokens
    assert (base.adapter, adapter.adapter) == ("", "sql")  # the router's filter reads it


@pytest.mark.parametrize(
    ("path", "auth", "body"),
    [
        ("/v1/completions", "Bearer key-mallory", _body(prompt="x")),  # 401 at the replica
        ("/v1/completions", "Bearer key-alice", b"{not json"),
        ("/v1/completions", "Bearer key-alice", _body(prompt=["a", ""])),  # an empty prompt
        ("/v1/chat/completions", "Bearer key-alice", _body(messages=[])),
        ("/v1/models", "Bearer key-alice", b""),
        ("/v1/completions", "Bearer key-alice", b"[1, 2]"),  # JSON, not an object
    ],
)
def test_requests_the_replica_will_refuse_are_not_routed_by_prefix(path, auth, body):
    assert _keys(KEYS).key(path, auth, body) == UNROUTED


# --- ASGI bridge ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app():
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=64))
    app = create_app(engine, ServerOptions(model_name=MODEL, shadow_rate=0.0, replica="r7"))
    app.state.server.loop.start()
    yield app
    app.state.server.loop.stop()


def _call(body: dict, path: str = "/v1/completions") -> HttpCall:
    headers = [(b"content-type", b"application/json")]
    return HttpCall("POST", path, b"", headers, json.dumps(body).encode(), UNROUTED)


async def _collect(app, call: HttpCall) -> tuple[ResponseStart, bytes]:
    pieces = [p async for p in call_asgi(app, call, "r7")]
    assert isinstance(pieces[0], ResponseStart) and all(isinstance(p, bytes) for p in pieces[1:])
    return pieces[0], b"".join(pieces[1:])


def test_a_call_gets_the_single_servers_response(app):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0.0}
    start, raw = asyncio.run(_collect(app, _call(body)))
    assert (start.status, start.replica) == (200, "r7")
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    bad, raw = asyncio.run(_collect(app, _call({**body, "max_tokens": 0})))
    assert bad.status == 400 and "max_tokens" in json.loads(raw)["error"]["message"]


def test_a_caller_that_stops_reading_aborts_the_request(app):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2000, "stream": True}

    async def first_chunk_then_leave() -> None:
        pieces = call_asgi(app, _call(body), "r7")
        async for piece in pieces:
            if isinstance(piece, bytes) and b"data:" in piece:
                break
        await pieces.aclose()  # what Ray does when the client is gone

    asyncio.run(first_chunk_then_leave())
    state = app.state.server
    stats = asyncio.run(_engine_stats(state))
    assert state.loop.in_flight == 0
    assert stats["running"] == stats["waiting"] == 0
    assert stats["private_blocks"] == stats["shared_blocks"] == 0  # nothing leaked


async def _engine_stats(state) -> dict[str, int]:
    return await state.loop.call(lambda: state.loop.engine.stats())


def test_audit_lines_name_the_replica(app):
    body = {"model": MODEL, "prompt": "audit me", "max_tokens": 2}
    asyncio.run(_collect(app, _call(body)))
    assert app.state.server.audit.recent
    assert {line["replica"] for line in app.state.server.audit.recent} == {"r7"}


# --- metrics merge -------------------------------------------------------------------------
def _exposition(hits: float) -> str:
    registry = CollectorRegistry()
    c = Counter("kvpage_hits", "Hits", ["kind"], registry=registry)
    c.labels("prefix").inc(hits)
    return generate_latest(registry).decode()


def test_merge_labels_each_sample_with_its_replica_and_keeps_values():
    merged = merge({"r0": _exposition(3), "r1": _exposition(5)})
    families = list(text_string_to_metric_families(merged))
    assert [f.name for f in families].count("kvpage_hits") == 1
    samples = {
        s.labels["replica"]: s.value
        for f in families
        for s in f.samples
        if s.name == "kvpage_hits_total"
    }
    assert samples == {"r0": 3.0, "r1": 5.0}
    assert all(s.labels.get("kind") == "prefix" for f in families for s in f.samples
               if s.name == "kvpage_hits_total")  # fmt: skip
