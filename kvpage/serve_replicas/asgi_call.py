"""One HTTP request, carried as data to a replica and played into its ASGI app there.

The ingress cannot hand a socket to another process, so it ships (method, path, headers, body)
and the replica runs its own kvpage app on it in-process: every check, error, and streaming
detail of the single server holds on a replica because it is the same code. The response comes
back as pieces: one `ResponseStart`, then body chunks as the app sends them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvpage.serve_replicas.prefix_router import RoutingKey

_DONE = object()
_APP_EXIT_TIMEOUT = 10.0  # seconds the app gets to wind down after the caller left


@dataclass(frozen=True, slots=True)
class HttpCall:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    key: RoutingKey  # read by the request router, never by the replica
    pin: str | None = None  # a replica id: only that replica may take it (fan-out calls)


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    replica: str = ""


async def call_asgi(app: Any, call: HttpCall, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Run `app` on `call`; yields the response start, then body chunks. If the caller stops
    reading (client gone, cancelled), the app sees `http.disconnect`, as from a real socket."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    task = asyncio.create_task(_run(app, _scope(call), _receiver(call.body, gone), out))
    try:
        while (message := await out.get()) is not _DONE:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])), replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, _APP_EXIT_TIMEOUT)


async def _run(app: Any, scope: dict, receive, out: asyncio.Queue) -> None:
    try:
        await app(scope, receive, out.put)
    finally:
        out.put_nowait(_DONE)


def _receiver(body: bytes, gone: asyncio.Event):
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


def _scope(call: HttpCall) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": call.headers,
        "client": ("ingress", 0),
        "server": ("replica", 0),
    }
