"""What the ingress answers when the replica serving a request dies (needs Ray installed, not
running): before the response starts, a 503 in OpenAI's error shape; mid-stream, an SSE error
event that says so, after whatever was already sent, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import ActorDiedError

from kvpage.serve_replicas.asgi_call import ResponseStart
from kvpage.serve_replicas.ray_serve import REPLICA_HEADER, IngressCore, _rest

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
