"""What the ingress answers when the replica serving a request dies (needs Ray installed, not
running): before the response starts, a 503 in OpenAI's error shape; mid-stream, an SSE error
event that says so, after whatever was already sent, then `data: [DONE]`. And what the ingress
records of a load or unload broadcast to every replica: only what they all accepted."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import ActorDiedError

from kvpage.serve_replicas.adapter_holdings import Holdings
from kvpage.serve_replicas.asgi_call import HttpCall, ResponseStart
from kvpage.serve_replicas.ray_serve import LOAD, REPLICA_HEADER, UNLOAD, IngressCore, _rest
from kvpage.serve_replicas.routing_key import UNROUTED

pytestmark = pytest.mark.ray


class _Pieces:
    """A DeploymentResponseGenerator stand-in: yields `pieces`, then raises ActorDiedError."""

    def __init__(self, pieces: list) -> None:
        self._pieces = list(pieces)
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._pieces:
            raise ActorDiedError()
        return self._pieces.pop(0)


class _Handle:
    def __init__(self, pieces: list) -> None:
        self.pieces = pieces

    def options(self, **_):
        return self

    @property
    def http(self):
        return self

    def remote(self, call):
        return _Pieces(self.pieces)


def _ingress(pieces: list) -> IngressCore:
    ingress = IngressCore.__new__(IngressCore)  # no Ray replica context here
    ingress.engines = _Handle(pieces)
    return ingress


def test_death_before_the_response_is_a_503():
    response = asyncio.run(_ingress([])._send(call=None))
    assert response.status_code == 503
    assert "replica serving this request died" in json.loads(response.body)["error"]["message"]


def test_death_mid_stream_ends_it_with_an_error_event():
    start = ResponseStart(200, [(b"content-type", b"text/event-stream")], "r1")

    async def run() -> list[bytes]:
        response = await _ingress([start, b"data: {}\n\n"])._send(call=None)
        assert (REPLICA_HEADER.encode(), b"r1") in response.raw_headers
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(run())
    assert chunks[0] == b"data: {}\n\n"
    event = json.loads(chunks[1].decode().removeprefix("data: "))
    assert "died mid-response" in event["error"]["message"]
    # the single server's ending for an engine failed mid-stream: OpenAI's error, then [DONE]
    assert chunks[2:] == [b"data: [DONE]\n\n"]
    assert set(event["error"]) == {"message", "type", "param", "code"}
    assert event["error"]["type"] == "server_error"


def test_death_mid_json_body_cuts_the_response():
    """Not a stream: nothing can be appended to a JSON body, so the connection is cut short."""
    start = ResponseStart(200, [(b"content-type", b"application/json")], "r1")

    async def run() -> list[bytes]:
        response = await _ingress([start, b'{"id"'])._send(call=None)
        return [chunk async for chunk in response.body_iterator]

    with pytest.raises(ActorDiedError):
        asyncio.run(run())


def test_a_client_that_leaves_mid_stream_cancels_the_replica_call():
    pieces = _Pieces([b"a", b"b", b"c"])

    async def leave_after_one() -> bytes:
        body = _rest(pieces)
        first = await body.__anext__()
        await body.aclose()
        return first

    assert asyncio.run(leave_after_one()) == b"a"
    assert pieces.cancelled


# --- the adapter record --------------------------------------------------------------------
class _Record:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def call(self, method: str, *args):
        self.calls.append((method, *args))


class _Broadcast:
    def __init__(self, replies: list) -> None:
        self.replies = replies

    def broadcast(self, method: str, call):
        assert method == "control"
        return self

    async def results_async(self, **_):
        return self.replies


def _control(replies: list, path: str, body: dict) -> tuple[int, list]:
    ingress = IngressCore.__new__(IngressCore)
    ingress.engines, ingress.record, ingress.app_name = _Broadcast(replies), _Record(), "t"
    call = HttpCall("POST", path, b"", [], json.dumps(body).encode(), UNROUTED)
    response = asyncio.run(ingress._to_every_replica(call))
    return response.status_code, ingress.record.calls


def _reply(replica: str, status: int) -> tuple:
    return replica, status, b"{}", Holdings(1)


def test_a_load_is_recorded_only_when_every_replica_accepted_it():
    load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    both = [_reply("r0", 200), _reply("r1", 200)]
    assert _control(both, LOAD, load) == (200, [("loaded", "sql", "/adapters/sql")])
    split = [_reply("r0", 200), _reply("r1", 400)]
    assert _control(split, LOAD, load) == (502, [])  # holds on r0 only: a new replica skips it
    lost = [_reply("r0", 200), RuntimeError("r1 died")]
    assert _control(lost, LOAD, load)[1] == []
    assert _control([_reply("r0", 401), _reply("r1", 401)], LOAD, load) == (401, [])


def test_an_unload_is_recorded_once_any_replica_dropped_the_adapter():
    # r1 never had it (it started while the adapter was being loaded): gone everywhere now
    replies = [_reply("r0", 200), _reply("r1", 404)]
    assert _control(replies, UNLOAD, {"lora_name": "sql"}) == (200, [("unloaded", "sql")])
    assert _control([_reply("r0", 404)], UNLOAD, {"lora_name": "sql"}) == (404, [])
